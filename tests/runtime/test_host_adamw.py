"""Host AdamW over flat state against torch.optim.AdamW's single-tensor path, bit for bit."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mtc.errors import KernelInputError, MTCError
from mtc.runtime.host_adamw import adamw_flat_, best_impl, host_pool

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8)
N, DECAY, STEPS = 1001, 600, 4


@pytest.fixture(scope="module")
def pool3():
    with host_pool(3) as pool:
        yield pool


def _inputs(n: int = N, steps: int = STEPS, scaled: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(1234)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    coefs = [torch.rand((), generator=gen) * 0.9 + 0.05 if scaled else None for _ in range(steps)]
    return p0, grads, coefs


def _torch_adamw(p0: torch.Tensor, grads: list[torch.Tensor], coefs: list[torch.Tensor | None], decay: int, wd: float) -> torch.Tensor:
    """torch.optim.AdamW(foreach=False, fused=False): a decayed group for the prefix, an undecayed one for the rest."""
    ws = [torch.nn.Parameter(p0[:decay].clone()), torch.nn.Parameter(p0[decay:].clone())]
    groups = [{"params": [w], "weight_decay": d} for w, d in zip(ws, (wd, 0.0)) if w.numel()]
    opt = torch.optim.AdamW(groups, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], foreach=False, fused=False)
    for g, c in zip(grads, coefs):
        for w, gi in zip(ws, (g[:decay], g[decay:])):
            w.grad = gi.clone()
            if c is not None:
                w.grad.mul_(c)  # as clip_grad_norm_ does
        opt.step()
    return torch.cat([w.detach() for w in ws])


def _flat(p0, grads, coefs, decay, wd, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, (g, c) in enumerate(zip(grads, coefs), start=1):
        adamw_flat_(p, g.clone(), m, v, **HP, weight_decay=wd, step=step, decay_numel=decay, grad_scale=c, **kw)
    return p, m, v


@pytest.mark.parametrize("chunk", [1, 7, 128, N])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_exact_matches_torch_adamw_bitwise(chunk, scaled, wd):
    p0, grads, coefs = _inputs(scaled=scaled)
    p, _, _ = _flat(p0, grads, coefs, DECAY, wd, chunk_numel=chunk)
    assert torch.equal(p, _torch_adamw(p0, grads, coefs, DECAY, wd))


@pytest.mark.parametrize("decay", [0, 1, N])
def test_exact_decay_prefix_edges(decay, pool3):
    p0, grads, coefs = _inputs()
    p, _, _ = _flat(p0, grads, coefs, decay, 0.1, chunk_numel=64, pool=pool3)
    assert torch.equal(p, _torch_adamw(p0, grads, coefs, decay, 0.1))


@pytest.mark.parametrize("impl", ["exact", "fused"])
def test_pools_of_one_and_three_give_identical_bits(impl, pool3):
    p0, grads, coefs = _inputs()
    with ThreadPoolExecutor(1) as pool1:
        one = _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=37, pool=pool1, impl=impl)
    three = _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=37, pool=pool3, impl=impl)
    caller = _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=37, impl=impl)
    for a, b, c in zip(one, three, caller):
        assert torch.equal(a, b) and torch.equal(a, c)
    if impl == "exact":
        assert torch.equal(three[0], _torch_adamw(p0, grads, coefs, DECAY, 0.1))


def test_fused_is_close_to_torch_adamw(pool3):
    p0, grads, coefs = _inputs(steps=10)
    p, _, _ = _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=100, pool=pool3, impl="fused")
    torch.testing.assert_close(p, _torch_adamw(p0, grads, coefs, DECAY, 0.1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", ["exact", "fused"])
def test_compute_out_is_the_new_param(dtype, impl, pool3):
    p0, grads, coefs = _inputs(steps=1)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    out = torch.full((N,), float("nan"), dtype=dtype)
    adamw_flat_(p, grads[0], m, v, **HP, weight_decay=0.1, step=1, decay_numel=DECAY, grad_scale=coefs[0],
                compute_out=out, pool=pool3, chunk_numel=50, impl=impl)
    assert torch.equal(out, p.to(dtype))


def test_pool_threads_leave_the_process_default_alone(pool3):
    before = torch.get_num_threads()
    p0, grads, coefs = _inputs(steps=1)
    with ThreadPoolExecutor(2) as fresh:  # workers not yet switched to one intra-op thread
        _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=10, pool=fresh)
        assert fresh.submit(torch.get_num_threads).result() == 1
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen == [before]


def test_default_impl_is_exact():
    assert best_impl() == "exact"


def _call(**over):
    args = dict(param=torch.zeros(8), grad=torch.zeros(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8))
    kw = dict(**HP, weight_decay=0.1, step=1, decay_numel=4)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    adamw_flat_(*args.values(), **kw)


@pytest.mark.parametrize("over,match", [
    (dict(param=torch.zeros(2, 4)), "param must be a contiguous 1-D tensor of 8"),
    (dict(exp_avg=torch.zeros(16)[::2]), "exp_avg must be a contiguous 1-D.*not contiguous"),
    (dict(grad=torch.zeros(9)), "grad must be a contiguous 1-D tensor of 8 elements"),
    (dict(exp_avg_sq=torch.zeros(8, dtype=torch.float16)), "exp_avg_sq must be float32"),
    (dict(grad=torch.zeros(8, dtype=torch.bfloat16)), "grad must be float32"),
    (dict(compute_out=torch.zeros(7, dtype=torch.bfloat16)), "compute_out must be a contiguous 1-D tensor of 8"),
    (dict(compute_out=torch.zeros(8, dtype=torch.int32)), "compute_out must be a floating dtype"),
    (dict(step=0), "step must be an int >= 1"),
    (dict(step=1.0), "step must be an int >= 1"),
    (dict(decay_numel=9), r"decay_numel must be in \[0, 8\]"),
    (dict(decay_numel=-1), r"decay_numel must be in \[0, 8\]"),
    (dict(chunk_numel=0), "chunk_numel must be >= 1"),
    (dict(impl="triton"), "impl must be 'exact' or 'fused'"),
    (dict(grad_scale=torch.ones(2)), "grad_scale must be a one-element floating tensor"),
    (dict(param=[0.0] * 8), "param must be a torch.Tensor"),
])
def test_bad_inputs_raise(over, match):
    with pytest.raises(KernelInputError, match=match) as e:
        _call(**over)
    assert isinstance(e.value, MTCError) and isinstance(e.value, ValueError)


def test_host_pool_rejects_zero_threads():
    with pytest.raises(KernelInputError, match="threads must be >= 1"):
        host_pool(0)


def test_worker_error_reaches_the_caller_after_all_workers_finish(pool3, monkeypatch):
    import mtc.runtime.host_adamw as host

    done: list[int] = []
    real = host.adamw_step_ref

    def flaky(p, *args, **kw):
        if p.data_ptr() == first_chunk_ptr:
            raise RuntimeError("boom")
        real(p, *args, **kw)
        done.append(p.numel())

    p0, grads, coefs = _inputs(steps=1)
    p = p0.clone()
    first_chunk_ptr = p.data_ptr()
    monkeypatch.setattr(host, "adamw_step_ref", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        adamw_flat_(p, grads[0], torch.zeros(N), torch.zeros(N), **HP, weight_decay=0.1, step=1, decay_numel=DECAY,
                    pool=pool3, chunk_numel=100)
    assert sum(done) == N - 100  # every other chunk was still updated before the error came back


def _three_fused_steps(n: int, decay: int, **kw) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        adamw_flat_(p, torch.randn(n, generator=gen), m, v, **HP, weight_decay=0.1, step=step, decay_numel=decay,
                    grad_scale=torch.tensor(0.5), impl="fused", **kw)
    return p, m, v


def test_fused_bits_do_not_depend_on_the_cut(pool3):
    # torch's fused kernel rounds its scalar tail differently from its vector body; with every cut
    # aligned (FUSED_ALIGN) chunks of any aligned size, pooled or not, and whole tensors agree.
    # 200K params with an odd decay boundary: without the aligned cut v differed in a few elements.
    n, decay = 200_003, 100_003
    whole = _three_fused_steps(n, decay, chunk_numel=n)
    for kw in (dict(chunk_numel=3 * 64, pool=pool3), dict(chunk_numel=1 << 18, pool=pool3), dict(chunk_numel=64)):
        for a, b in zip(_three_fused_steps(n, decay, **kw), whole):
            assert torch.equal(a, b), kw


@pytest.mark.parametrize("impl", ["exact", "fused"])
def test_a_clip_coefficient_of_one_is_not_multiplied(impl, monkeypatch):
    # x * 1.0 == x bit for bit: the pass over the gradient is skipped (a 0-dim tensor of 1.0, as the
    # clip coefficient is when the norm is under the limit), and the result equals torch's with it
    import mtc.runtime.host_adamw as host

    seen: list[object] = []
    name = "adamw_step_ref" if impl == "exact" else "_fused_chunk"
    real = getattr(host, name)

    def spy(*a, grad_scale=None, **kw):
        seen.append(grad_scale)
        real(*a, grad_scale=grad_scale, **kw)

    monkeypatch.setattr(host, name, spy)
    p0, grads, _ = _inputs(steps=2)
    coefs = [torch.tensor(1.0), torch.tensor(0.5)]
    p, _, _ = _flat(p0, grads, coefs, DECAY, 0.1, chunk_numel=N, impl=impl)
    assert seen[0] is None and seen[1] is not None
    if impl == "exact":
        assert torch.equal(p, _torch_adamw(p0, grads, coefs, DECAY, 0.1))


def test_fused_scales_the_gradient_inside_the_kernel(monkeypatch):
    # clipping fired: torch's kernel divides by 1 / coef as it reads the gradient (no separate pass)
    # and stores it back scaled, as clip_grad_norm_ leaves .grad
    p0, grads, _ = _inputs(steps=1)
    g = grads[0].clone()
    adamw_flat_(p0.clone(), g, torch.zeros(N), torch.zeros(N), **HP, weight_decay=0.1, step=1, decay_numel=DECAY,
                grad_scale=torch.tensor(0.3), impl="fused", chunk_numel=100)
    torch.testing.assert_close(g, grads[0] * 0.3, rtol=2e-7, atol=0)
    assert not torch.equal(g, grads[0])


def test_tune_strategy_times_each_way_and_keeps_the_fastest(pool3):
    from mtc.runtime.host_adamw import HostStrategy, tune_strategy

    assert tune_strategy("exact", pool3, 3, 0) == HostStrategy()
    for impl, names in (("exact", {"pool/262144", "caller/262144", "whole"}),
                        ("fused", {"pool/262144", "pool/1048576", "caller/262144", "whole"})):
        before = torch.get_num_threads()
        st = tune_strategy(impl, pool3, 3, 100_000, compute_dtype=torch.bfloat16, repeats=1)
        rates = dict(st.rates)
        assert set(rates) == names and all(r > 0 for r in rates.values())
        assert rates[st.name] == max(rates.values())
        assert st.name in st.describe(impl) and "timed" in st.describe(impl)
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("impl", ["exact", "fused"])
def test_every_strategy_gives_the_same_bits(impl, pool3):
    from mtc.runtime.host_adamw import HostStrategy

    p0, grads, coefs = _inputs(n=20_011, steps=3)
    out = []
    for st in (HostStrategy(True, 64), HostStrategy(False, 128), HostStrategy(False, 0)):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for step, (g, c) in enumerate(zip(grads, coefs), start=1):
            st.run(p, g.clone(), m, v, pool=pool3, threads=2, **HP, weight_decay=0.1, step=step, decay_numel=9_001,
                   grad_scale=c, impl=impl)
        out.append((p, m, v))
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


def test_the_device_adamw_warm_up_launches_both_variants(monkeypatch):
    # on CUDA the optimizer compiles the Triton AdamW at start-up, not mid-step on two threads;
    # here (interpreter) the call itself is checked: its arguments are the kernel's
    import mtc.kernels.adamw as kadamw
    from mtc.runtime.optimizer import _warm_device_adamw

    calls = []
    real = kadamw.adamw_step_
    monkeypatch.setattr(kadamw, "adamw_step_", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    _warm_device_adamw(torch.device("cpu"), torch.bfloat16)
    assert len(calls) == 2 and all(c["step"] == 1 and c["decay_numel"] == 2048 for c in calls)
