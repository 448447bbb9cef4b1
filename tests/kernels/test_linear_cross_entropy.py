"""Fused linear + cross-entropy against the unfused torch computation: loss and every gradient.

Without CUDA the row kernel runs in Triton's interpreter (tiny shapes, fp32 and fp16); the `gpu`
tests add bf16 at a Llama-sized head and check that the full logits are never allocated.
"""

from __future__ import annotations

import mtc.kernels.linear_cross_entropy as lce
import pytest
import torch
from mtc.kernels.linear_cross_entropy import chunk_rows_for, linear_cross_entropy, linear_cross_entropy_ref

from mtc.errors import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, H, V, dtype=torch.float32, bias=True, ignored=3, device=DEVICE, lead=(1,)):
    x = torch.randn(*lead, rows, H, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=device, dtype=dtype) / H**0.5).requires_grad_()
    b = (torch.randn(V, device=device, dtype=dtype) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, V, (*lead, rows), device=device)
    t.view(-1)[torch.randperm(t.numel(), device=device)[:ignored]] = -100
    return x, w, b, t


def _compare(x, w, b, t, chunk_rows=0, grad_scale=2.5, atol=1e-5, rtol=1e-5):
    leaves = [p for p in (x, w, b) if p is not None]
    got = linear_cross_entropy(x, w, b, t, chunk_rows=chunk_rows)
    got_grads = torch.autograd.grad(got * grad_scale, leaves)
    ref_leaves = [p.detach().clone().requires_grad_() for p in leaves]
    rx, rw, rb = ref_leaves[0], ref_leaves[1], (ref_leaves[2] if b is not None else None)
    want = linear_cross_entropy_ref(rx, rw, rb, t)
    want_grads = torch.autograd.grad(want * grad_scale, ref_leaves)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for name, g, r in zip(("dx", "dw", "db"), got_grads, want_grads):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.float(), r.float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("chunk_rows", [0, 1, 7, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fp32_matches_unfused(chunk_rows, bias):
    _compare(*_inputs(37, 24, 50, bias=bias), chunk_rows=chunk_rows)


@pytest.mark.parametrize("vocab", [53, 64, 17])
def test_vocab_over_several_blocks(monkeypatch, vocab):
    """Vocabulary wider than one block: the per-lane running max / sum-exp and the gradient pass
    loop (the last block partly masked; at 17, lanes that never see a column)."""
    monkeypatch.setitem(lce._BLOCK_V, "cpu", 16)
    monkeypatch.setitem(lce._BLOCK_V, "cuda", 16)
    x, w, b, t = _inputs(9, 16, vocab, lead=(2,))
    x.data[0, 0] *= 40  # a row whose logits lie far apart: its max moves between blocks
    _compare(x, w, b, t, chunk_rows=4)


def test_large_logits_are_stable():
    """Logits in the hundreds: the online softmax must not overflow."""
    x, w, b, t = _inputs(11, 8, 40)
    with torch.no_grad():
        w.mul_(60.0)
    _compare(x, w, b, t, atol=1e-4, rtol=1e-5)


def test_loss_only_without_grad():
    x, w, b, t = _inputs(13, 8, 21)
    with torch.no_grad():
        got = linear_cross_entropy(x, w, b, t, chunk_rows=5)
        want = linear_cross_entropy_ref(x, w, b, t)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the torch path serves CPUs without the interpreter")
def test_torch_path_without_interpreter(monkeypatch):
    monkeypatch.setattr(lce, "_INTERPRETED", False)
    _compare(*_inputs(19, 12, 30), chunk_rows=6)


def test_half_precision():
    """fp16 (right in the interpreter, unlike bf16): loss in fp32, gradients in fp16."""
    _compare(*_inputs(17, 16, 33, dtype=torch.float16), chunk_rows=8, atol=2e-3, rtol=2e-2)


def test_chunk_rows_for():
    assert chunk_rows_for(8192, 128256, 4096) == 8192  # 2.1 GB of bf16 logits: chunks would hold more (fp32 dW)
    assert chunk_rows_for(65536, 128256, 4096) == 8192  # 8 chunks: logits chunk about 4x x's size
    # GPT-2: 0.8 GB of bf16 logits fit one product (8 chunks of 1024 rows ran 1.2x torch.compile's time)
    assert chunk_rows_for(8192, 50257, 1600) == 8192
    assert chunk_rows_for(32768, 50257, 1600) == 4096  # 3.3 GB: chunks again, of 4x x's size
    assert chunk_rows_for(8192, 50257, 1600, itemsize=4) == 8192  # fp32: 1.6 GB, one product
    assert chunk_rows_for(10, 50, 100) == 10
    assert chunk_rows_for(1, 10**6, 1) == 1


@pytest.mark.parametrize(
    "case,match",
    [
        ("hidden", "expected x"),
        ("dtype", "one dtype"),
        ("bias", "bias must have shape"),
        ("rows", "one entry per row"),
        ("target", "outside the vocabulary"),
    ],
)
def test_errors(case, match):
    x, w, b, t = _inputs(5, 8, 11, ignored=0)
    if case == "hidden":
        w = torch.zeros(11, 9, device=DEVICE)
    elif case == "dtype":
        w = w.detach().double()
    elif case == "bias":
        b = torch.zeros(12, device=DEVICE)
    elif case == "rows":
        t = t[:, :4]
    else:
        if DEVICE == "cuda":
            pytest.skip("on CUDA an out-of-range target gives a NaN loss instead (no host sync): test_out_of_range_target_rows")
        t = t.clone()
        t[0, 2] = 11
    with pytest.raises(KernelInputError, match=match):
        linear_cross_entropy(x, w, b, t)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_out_of_range_target_rows(kernel, monkeypatch):
    """Rows whose target is outside [0, V) (and not ignore_index) read nothing outside the row: their
    loss is NaN and their gradient row has no one-hot term; the other rows are exact. (On CUDA this
    replaces the host check, which would synchronise every call.)"""
    monkeypatch.setattr(lce, "_INTERPRETED", kernel and DEVICE == "cpu")
    V = 13
    logits = torch.randn(4, V, device=DEVICE)
    targets = torch.tensor([3, V, -100, -5], device=DEVICE)
    n_valid = torch.tensor(3.0, device=DEVICE)
    grad = logits.clone()
    loss = lce._rows_ce(grad, targets, n_valid, -100, write_grad=True)
    lse = torch.logsumexp(logits, 1)
    assert torch.isnan(loss[1]) and torch.isnan(loss[3])
    torch.testing.assert_close(loss[0], lse[0] - logits[0, 3])
    assert loss[2] == 0 and not grad[2].any()  # ignored row
    soft = torch.softmax(logits, 1) / 3.0
    torch.testing.assert_close(grad[1], soft[1])  # no -1 anywhere: the target is not in the row
    torch.testing.assert_close(grad[3], soft[3])
    want0 = soft[0].clone()
    want0[3] -= 1 / 3.0
    torch.testing.assert_close(grad[0], want0)


def test_odd_vocabulary_is_padded_with_zero_rows():
    """An odd vocabulary gets zero weight (and bias) rows up to a multiple of 64 (cuBLAS's aligned
    kernels); a multiple of 8 is used as is. The fp32 tests above run odd vocabularies (50, 53, 33)."""
    w, b = torch.randn(50257, 4), torch.randn(50257)
    wp, bp = lce._padded(w, b)
    assert wp.shape == (50304, 4) and bp.shape == (50304,)
    assert torch.equal(wp[:50257], w) and not wp[50257:].any() and not bp[50257:].any()
    w8 = torch.randn(128256, 2)
    assert lce._padded(w8, None) == (w8, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_chunked_weight_gradient_accumulates_in_fp32(dtype):
    a, b = torch.randn(3, 6, 10, dtype=dtype), torch.randn(3, 10, 4, dtype=dtype)
    acc = None
    for i in range(3):
        acc = lce._mm_acc(acc, a[i], b[i])
    assert acc.dtype == torch.float32
    want = sum((a[i].float() @ b[i].float()).to(dtype).float() for i in range(3))  # each product rounded once
    torch.testing.assert_close(acc, want, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_rows", [0, 512], ids=["auto", "chunks512"])
def test_gpu_bf16_llama_head_below_unfused_memory(chunk_rows):
    """bf16 at a Llama-3 head (vocab 128256, hidden 4096, 4096 rows), chosen chunking (one chunk
    here) and 8 chunks (fp32 dW accumulation in cuBLAS): matches the unfused loss and gradients,
    and allocates less than half the fp32 logits (2.1 GB) plus the gradients' share."""
    torch.manual_seed(0)
    x, w, b, t = _inputs(4096, 4096, 128256, dtype=torch.bfloat16, bias=False, ignored=100, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(x, w, None, t, chunk_rows=chunk_rows)
    dx, dw = torch.autograd.grad(loss, (x, w))
    peak = torch.cuda.max_memory_allocated() - base
    logits_fp32 = 4096 * 128256 * 4
    assert peak < 0.5 * logits_fp32 + 2 * w.numel() * 4, f"peak {peak / 2**30:.2f} GiB"
    rx, rw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = linear_cross_entropy_ref(rx, rw, None, t)
    rdx, rdw = torch.autograd.grad(want, (rx, rw))
    torch.testing.assert_close(loss, want, atol=2e-3, rtol=2e-3)
    assert lce._fp32_out(x), "cuBLAS cannot accumulate dW in fp32 here: the head falls back to separate adds"
    for g, r in ((dx, rdx), (dw, rdw)):
        rel = (g.float() - r.float()).norm() / r.float().norm()
        assert rel < 2e-2, float(rel)


@pytest.mark.parametrize("interpreted", [True, False], ids=["kernel", "torch"])
def test_masked_rows_and_a_step_weight(monkeypatch, interpreted):
    """SFT: most targets ignored, the gradient weighted by this micro-batch's share of the step's
    targets (the executor's c_i / sum(c)): the fused op (scaled variant) matches torch's."""
    if not interpreted:
        monkeypatch.setattr(lce, "_INTERPRETED", False)
    x, w, b, t = _inputs(12, 8, 30, ignored=9)
    scale = torch.tensor(3 / 17, device=DEVICE)
    loss, dx, dw, db = torch.ops.mtc.linear_cross_entropy_fwd_bwd_scaled(x, w, b, t, scale, -100, 5)
    ref = linear_cross_entropy_ref(x, w, b, t)
    want = torch.autograd.grad(ref * scale, [x, w, b])
    torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-5)
    for g, r in zip((dx, dw, db), want):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert (dx.view(-1, 8)[t.view(-1) == -100] == 0).all()  # an ignored row sends no gradient back


@pytest.mark.parametrize("interpreted", [True, False], ids=["kernel", "torch"])
def test_all_rows_ignored(monkeypatch, interpreted):
    """A micro-batch without targets: NaN loss (0 / 0, as torch's mean) but zero gradients, even
    with a zero step weight, so the executor can weight it by 0 and leave it out of the loss."""
    if not interpreted:
        monkeypatch.setattr(lce, "_INTERPRETED", False)
    x, w, b, t = _inputs(6, 8, 30, ignored=6)
    for s in (0.0, 0.5):
        loss, dx, dw, db = torch.ops.mtc.linear_cross_entropy_fwd_bwd_scaled(x, w, b, t, torch.tensor(s, device=DEVICE), -100, 0)
        assert torch.isnan(loss) and torch.isnan(linear_cross_entropy_ref(x, w, b, t))
        assert not dx.any() and not dw.any() and not db.any()

