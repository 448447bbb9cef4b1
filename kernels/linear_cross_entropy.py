"""Fused linear + cross-entropy: mean CE of ``x @ W^T (+ b)`` against targets, without the (N, V) logits.

A language model's head turns N hidden rows into N x V logits (8192 x 128256 in fp32 is 4.2 GB,
more than the rest of a layer's activations) only to reduce each row to one number. Here the
logits never exist in fp32, and beyond `ONE_PRODUCT_BYTES` of them the rows go in chunks of C
rows (`chunk_rows_for`):

1. ``logits_c = x_c @ W^T (+ b)`` in x's dtype (cuBLAS, as the unfused linear does);
2. one Triton program per row walks the vocabulary in blocks twice: an online max / sum-exp gives
   the row's logsumexp and loss ``lse - logit[target]``; the second pass overwrites the row in
   place with ``d loss / d logits = (softmax - onehot(target)) / n_valid`` (the mean over rows whose
   target is not ``ignore_index``; ignored rows get loss 0 and gradient 0, as in torch);
3. ``dx_c = dlogits_c @ W``, ``dW += dlogits_c^T @ x_c``, ``db += dlogits_c.sum(0)``.

The gradients are computed in the forward: the loss is the last op of the model, so its backward
only scales them by the incoming gradient, and no logits are saved or recomputed. Without
gradients (evaluation) only the loss pass runs.

The CE statistics are fp32 whatever x's dtype (the traced models upcast logits with ``.float()``
before the loss); the logits gradient is stored in x's dtype for the two backward matmuls, as
autograd's cast-back does. ``linear_cross_entropy_ref`` is the plain torch computation it matches.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mtc.errors import KernelInputError

__all__ = ["ONE_PRODUCT_BYTES", "LinearCrossEntropy", "chunk_rows_for", "linear_cross_entropy", "linear_cross_entropy_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Kernels are interpreted iff this was set when they were defined (tests/conftest.py sets it).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Widest vocabulary block one program holds per loop step: 4096 fp32 lanes fit the registers of 8
# warps on CUDA; the interpreter runs one numpy op per block, so wider is faster there.
_BLOCK_V = {"cuda": 4096, "cpu": 16384}


@triton.jit
def _ce_rows_kernel(
    logits_ptr, stride_row, targets_ptr, n_valid_ptr, loss_ptr,
    V, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # grid: (rows,); one program owns one row of the chunk's logits
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index

    # pass 1: online max and sum of exp over the row, in fp32, per lane: each lane keeps its own
    # running max and sum, and the lanes are combined once at the end. (Reducing across the block
    # at every step, as this did, put two block-wide reductions, each with its barriers, on every
    # 4096 elements: the kernel ran GPT-2's head logits at ~40 % of the H100's memory bandwidth.)
    # A lane that has seen only masked columns (-inf) keeps max -inf and sum 0; it subtracts 0, not
    # its max, so no inf - inf arises (exp(-inf - 0) is 0).
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - m_sub) + tl.exp(x - m_sub)
        m_vec = m_new
    m_i = tl.max(m_vec, 0)
    s_i = tl.sum(s_vec * tl.exp(m_vec - m_i), 0)
    lse = m_i + tl.log(s_i)
    # a target outside [0, V) that is not ignore_index is read nowhere: its row's loss is NaN (no host
    # check on CUDA: that would synchronise every call; see _check_targets)
    in_range = (target >= 0) & (target < V)
    safe_target = tl.where(valid & in_range, target, 0).to(tl.int64)
    x_t = tl.load(base + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, tl.where(in_range, lse - x_t, float("nan")), 0.0))

    if WRITE_GRAD:
        # pass 2: the row becomes its gradient, (softmax - onehot) / n_valid, in the logits' dtype
        n_valid = tl.load(n_valid_ptr).to(tl.float32)
        scale = tl.where(valid, 1.0 / n_valid, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where((cols == safe_target) & in_range, p - 1.0, p) * scale
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


# Logits (in x's dtype) up to this size are computed in one product. Chunks cost time: dW
# accumulates in fp32 over them and each product is smaller. GPT-2's head at 8192 x 1600 -> 50257
# (0.8 GB of bf16 logits) ran 9.59 ms in 8 chunks on the H100 against torch.compile's 7.95
# unchunked (bench_fusion-vm-20261123T040705). The planner's workspace reserves the head's whole
# logits in fp32 (`mtc.planner.gpu_workspace`), twice this kernel's one-product peak.
ONE_PRODUCT_BYTES = 2 * 2**30


def chunk_rows_for(n_rows: int, vocab: int, hidden: int, itemsize: int = 2) -> int:
    """Rows per chunk: all rows at once while the logits fit `ONE_PRODUCT_BYTES` (``itemsize``:
    x's element size) or chunking would not lower the peak memory, else chunks whose logits are
    about four times as large as x (n_rows x hidden).

    One chunk holds the (N, V) logits in x's dtype and computes dW in one product. Several chunks
    hold C rows of logits but accumulate dW in fp32 (V x H x 4 bytes, read and written by every
    chunk's product): they save memory only when N > C + 2H, and cost time (Llama 3's head, 8192 x
    4096 -> 128256 on an H100: 48 ms in 8 chunks, torch.compile's unchunked 40 ms). Smaller chunks
    also starve the matmuls (256-row chunks ran them 20% slower than one product)."""
    if n_rows * vocab * itemsize <= ONE_PRODUCT_BYTES:
        return n_rows
    chunks = max(1, math.ceil(vocab / max(4 * hidden, 1)))
    rows = max(1, math.ceil(n_rows / chunks))
    return n_rows if n_rows <= rows + 2 * hidden else rows


_FP32_OUT: dict[torch.device, bool] = {}


def _fp32_out(a: torch.Tensor) -> bool:
    """Whether this device's half matmuls can write an fp32 sum directly (``out_dtype``, cuBLAS
    with beta = 1): probed once per device on a tiny product, against the float computation."""
    if not a.is_cuda or a.dtype == torch.float32:
        return False
    if a.device not in _FP32_OUT:
        try:
            # small integers, exact in half precision; no torch.randn: the probe must not move the RNG
            x = (torch.arange(128, device=a.device).reshape(16, 8) % 7 - 3).to(a.dtype)
            acc = torch.ones(16, 16, device=a.device)
            torch.addmm(acc, x, x.t(), out_dtype=torch.float32, out=acc)
            _FP32_OUT[a.device] = bool(torch.allclose(acc, 1 + x.float() @ x.float().t(), atol=1e-3, rtol=1e-3))
        except (TypeError, RuntimeError):
            _FP32_OUT[a.device] = False
    return _FP32_OUT[a.device]


def _mm_acc(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in fp32 (``a @ b`` when acc is None), in place. CUDA half: cuBLAS adds the
    fp32 product into acc itself (no rounding, no separate add over the (V, H) accumulator, which
    cost Llama 3's head 68 ms in 32 adds); elsewhere the product is rounded to a's dtype, then added."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if _fp32_out(a):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return torch.mm(a, b).float() if acc is None else acc.add_(torch.mm(a, b))


def _padded(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight`` (and ``bias``) with zero rows up to a multiple of 64 when the vocabulary is not a
    multiple of 8: cuBLAS runs unaligned kernels on such a dimension (GPT-2's 50257: the three head
    matmuls 5x slower on an H100). Padded logits columns are outside the CE rows' [0, V), their
    gradient meets zero weight rows in dx, and their dW rows are dropped."""
    V = weight.shape[0]
    if V % 8 == 0:
        return weight, bias
    Vp = -(-V // 64) * 64
    wp = weight.new_zeros(Vp, weight.shape[1])
    wp[:V] = weight
    bp = None
    if bias is not None:
        bp = bias.new_zeros(Vp)
        bp[:V] = bias
    return wp, bp


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor) -> None:
    """Raise KernelInputError unless the inputs can go to the kernel."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelInputError(
            f"linear_cross_entropy: expected x (..., H) and weight (V, H); got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise KernelInputError(f"linear_cross_entropy: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise KernelInputError(
            f"linear_cross_entropy: x, weight and bias must share one dtype of float16, bfloat16, float32; got "
            f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}"
        )
    if targets.dtype not in (torch.int64, torch.int32) or targets.numel() != x.numel() // max(x.shape[-1], 1):
        raise KernelInputError(
            f"linear_cross_entropy: targets must be int64/int32 with one entry per row of x ({x.numel() // max(x.shape[-1], 1)}); "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    devices = {t.device for t in (x, weight, targets, bias) if t is not None}
    if len(devices) != 1:
        raise KernelInputError(f"linear_cross_entropy: all inputs must be on one device, got {sorted(map(str, devices))}")


def _check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Reject targets outside [0, vocab) that are not ``ignore_index``, where that costs no device
    synchronisation: on the CPU. On CUDA the check would stall the host once per call (every
    micro-batch's head, inside the engine's layer loop), so there such a row reads nothing and its
    loss is NaN instead, which the trainer reports as a non-finite step; `mtc train` checks the
    token ids against the vocabulary before it starts (`TokenFile.check_vocab`)."""
    if targets.is_cuda:
        return
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        t = targets[bad][0].item()
        raise KernelInputError(f"linear_cross_entropy: target {t} is outside the vocabulary [0, {vocab}) and not ignore_index {ignore_index}")


def _uses_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and _INTERPRETED)


def _rows_ce(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    """Per-row losses (fp32) of a logits chunk; with write_grad the chunk becomes d loss / d logits."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    if _uses_kernel(logits):
        block = min(triton.next_power_of_2(vocab), _BLOCK_V[logits.device.type])
        _ce_rows_kernel[(rows,)](
            logits, logits.stride(0), targets, n_valid, loss, vocab, ignore_index,
            WRITE_GRAD=write_grad, BLOCK_V=block, num_warps=8 if block >= 2048 else 4,
        )
        return loss
    # plain torch on the CPU without the interpreter: the same math, one chunk at a time
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=1)
    valid = targets != ignore_index
    in_range = (targets >= 0) & (targets < vocab)
    safe = torch.where(valid & in_range, targets, 0).long()
    loss.copy_(torch.where(valid, torch.where(in_range, lse - lf.gather(1, safe[:, None])[:, 0], float("nan")), 0.0))
    if write_grad:
        g = torch.exp(lf - lse[:, None])
        g.scatter_add_(1, safe[:, None], torch.where(in_range, -1.0, 0.0).to(lse.dtype)[:, None])
        logits.copy_(g * torch.where(valid, 1.0 / n_valid, 0.0)[:, None])
    return loss


def _forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int, chunk_rows: int, with_grads: bool, grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The chunked computation: loss, and with_grads also dx, dW, db (db empty without bias),
    multiplied by ``grad_scale`` (a 0-dim tensor) if given: the logits gradient is divided by
    n_valid / grad_scale instead of n_valid, so no pass over dW scales it afterwards."""
    _check(x, weight, bias, targets)
    H, V = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, H)
    t = targets.reshape(-1)
    N = x2.shape[0]
    _check_targets(t, V, ignore_index)
    C = chunk_rows if chunk_rows > 0 else chunk_rows_for(N, V, H, x.element_size())
    n_valid = (t != ignore_index).sum().to(torch.float32)
    # the gradient's divisor (grad_scale 0 gives inf: zero gradients, as multiplying would)
    g_div = n_valid if grad_scale is None else n_valid / grad_scale.to(torch.float32)
    wp, bp = _padded(weight, bias)
    wt = wp.t()
    row_losses = torch.empty(N, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x2) if with_grads else None
    one_chunk = C >= N
    # several chunks accumulate dW / db in fp32 (see _mm_acc); one chunk is one product, as unfused
    dw: torch.Tensor | None = None
    db = torch.zeros(V, dtype=torch.float32, device=x.device) if with_grads and bias is not None and not one_chunk else None
    buf = torch.empty(min(C, N), wp.shape[0], dtype=x2.dtype, device=x2.device)
    for lo in range(0, N, C):
        hi = min(lo + C, N)
        xc = x2[lo:hi]
        full = buf[: hi - lo]  # (rows, padded V); the CE sees the first V columns
        if bp is not None:
            torch.addmm(bp, xc, wt, out=full)
        else:
            torch.mm(xc, wt, out=full)
        logits = full[:, :V]
        row_losses[lo:hi] = _rows_ce(logits, t[lo:hi], g_div, ignore_index, with_grads)
        if with_grads:
            torch.mm(full, wp, out=dx[lo:hi])
            if one_chunk:
                dw = torch.mm(full.t(), xc)
                if bias is not None:
                    db = logits.sum(0)
            else:
                dw = _mm_acc(dw, full.t(), xc)
                if db is not None:
                    db += logits.sum(0, dtype=torch.float32)
    loss = row_losses.sum() / n_valid
    if not with_grads:
        return (loss,)
    db_out = db.to(weight.dtype) if db is not None else x.new_empty(0)
    return loss, dx.view(x.shape), dw[:V].to(weight.dtype), db_out


# Custom ops: tracing (make_fx, export, torch.compile) keeps each one node with known output shapes.
@torch.library.custom_op("mtc::linear_cross_entropy_loss", mutates_args=())
def _loss_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int, chunk_rows: int
) -> torch.Tensor:
    return _forward(x, weight, bias, targets, ignore_index, chunk_rows, with_grads=False)[0]


@_loss_op.register_fake
def _(x, weight, bias, targets, ignore_index, chunk_rows):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("mtc::linear_cross_entropy_fwd_bwd", mutates_args=())
def _fwd_bwd_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, weight, bias, targets, ignore_index, chunk_rows, with_grads=True)  # type: ignore[return-value]


@_fwd_bwd_op.register_fake
def _(x, weight, bias, targets, ignore_index, chunk_rows):
    db = x.new_empty((weight.shape[0],) if bias is not None else (0,))
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape), db


@torch.library.custom_op("mtc::linear_cross_entropy_fwd_bwd_scaled", mutates_args=())
def _fwd_bwd_scaled_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, grad_scale: torch.Tensor,
    ignore_index: int, chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_cross_entropy_fwd_bwd`` with dx, dW, db already multiplied by the 0-dim
    ``grad_scale`` (compiled joint graphs fold the backward's ``* grad`` into it)."""
    if grad_scale.dim() != 0:
        raise KernelInputError(f"linear_cross_entropy: grad_scale must be a 0-dim tensor, got shape {tuple(grad_scale.shape)}")
    return _forward(x, weight, bias, targets, ignore_index, chunk_rows, with_grads=True, grad_scale=grad_scale)  # type: ignore[return-value]


@_fwd_bwd_scaled_op.register_fake
def _(x, weight, bias, targets, grad_scale, ignore_index, chunk_rows):
    db = x.new_empty((weight.shape[0],) if bias is not None else (0,))
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape), db


class LinearCrossEntropy(torch.autograd.Function):
    """Autograd wrapper: gradients are computed in the forward when any input needs one."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, ignore_index, chunk_rows):
        if any(ctx.needs_input_grad[:3]):
            loss, dx, dw, db = torch.ops.mtc.linear_cross_entropy_fwd_bwd(x, weight, bias, targets, ignore_index, chunk_rows)
            ctx.save_for_backward(dx, dw, db)
        else:
            loss = torch.ops.mtc.linear_cross_entropy_loss(x, weight, bias, targets, ignore_index, chunk_rows)
        ctx.has_bias = bias is not None
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw, db = ctx.saved_tensors
        return dx * grad, dw * grad, (db * grad if ctx.has_bias else None), None, None, None


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int = -100, chunk_rows: int = 0,
) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight^T + bias`` (rows of x, targets ignoring ``ignore_index``),
    as an fp32 scalar, never holding more than ``chunk_rows`` rows of logits (0: about x's size)."""
    return LinearCrossEntropy.apply(x, weight, bias, targets, int(ignore_index), int(chunk_rows))


def linear_cross_entropy_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The unfused computation: full logits, upcast to fp32, torch's cross-entropy."""
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]).float(), targets.reshape(-1), ignore_index=ignore_index)
