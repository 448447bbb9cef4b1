"""torch's cuDNN attention kernels as a second backend of mtc's flash-attention ops.

On Hopper, cuDNN's fused attention (the kernels torch's SDPA and torch.compile call) runs the
backward about 1.6x faster than the Triton kernels of `flash_attention` at Llama shapes (measured
on an H100: 2.55 ms vs 4.04 ms for 8192 tokens, 32 heads, D 128). The compiled graph keeps the
``mtc::flash_attention_fwd/bwd`` nodes; at run time each op may launch cuDNN instead of Triton
when three things hold: cuDNN attention exists in this torch and takes the problem (CUDA, fp16 or
bf16, D a multiple of 8 up to 128), its results agree with the Triton kernels' on the first call
for that shape (out, logsumexp, and every gradient: the two backends then share the saved
(out, logsumexp) pair, so a cuDNN forward may feed a Triton backward and vice versa), and it is
the faster of the candidates timed (kernels/tuning.py). Grouped KV heads go to cuDNN in two ways,
each a candidate of its own: as they are (cuDNN maps query heads to KV heads itself and sums
their gradients), or repeated for each query group first and the gradients summed back over the
group (done with torch ops, two copies of k and v each way, and two reductions, per call: ~0.6 ms
of a 20 ms Llama-8B layer on the H200, where torch.compile's kernels had none; now one Triton pass
each, `kernels/kv_groups.py`: k and v repeated straight into q's layout, each group's gradients
summed in fp32 straight into k's and v's). cuDNN's outputs are returned as they
are when their layout is the one the ops promise, not copied into buffers of ours: the output is
laid out as ``torch.empty_like(q)`` (cuDNN allocates it in q's dim order too), the gradients as
their inputs, and the output's gradient is handed over in the output's layout.
"""

from __future__ import annotations

import warnings

import torch
from mtc.kernels.kv_groups import expand_heads, sum_groups

__all__ = ["agree", "backward", "forward", "usable", "warn_unavailable"]

aten = torch.ops.aten


def usable(q: torch.Tensor) -> bool:
    """Whether cuDNN attention may take this problem (CUDA, half precision, D % 8 == 0, D <= 128)."""
    D = q.shape[-1]
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 128
        and hasattr(aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available()
    )


def _as_allocated(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it has the layout ``torch.empty_like(like)`` would give (what the backward
    op's fake implementation promises, and compiled graphs view), else a copy in that layout."""
    if t.stride() == torch.empty_like(like, device="meta").stride():
        return t
    out = torch.empty_like(like)
    out.copy_(t)
    return out


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            *, grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output (laid out as ``torch.empty_like(q)``) and its fp32 row logsumexp (B, H, T),
    natural log.
    ``grouped``: hand cuDNN the KV heads as they are (it maps query head h to KV head h // rep
    itself); else each KV head is repeated for its query group first (k and v copied, laid out as q)."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = (k, v) if grouped or rep == 1 else (expand_heads(k, rep, q), expand_heads(v, rep, q))
    out, stats = aten._scaled_dot_product_cudnn_attention(q, kk, vv, None, True, 0.0, causal, False, scale=scale)[:2]
    lse = stats.reshape(q.shape[:-1])
    return _as_allocated(out, q), lse.contiguous()  # no copy when they are laid out as the op promises


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, causal: bool, scale: float, *, grouped: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the layouts of q, k, v; dk, dv summed over each KV head's query group (by
    cuDNN itself when ``grouped``, else after the expanded heads' gradients come back)."""
    T, H_KV = q.shape[2], k.shape[1]
    rep = q.shape[1] // H_KV
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
    kk, vv = (k, v) if grouped or rep == 1 else (expand_heads(k, rep, q), expand_heads(v, rep, q))
    gq, gk, gv = aten._scaled_dot_product_cudnn_attention_backward(
        # dO in O's layout (no copy when it is: the graphs hand it so). O is laid out like q and dO
        # like O, so q's strides fix all three: torch caches cuDNN's backward graph by q, k, v's alone
        _as_allocated(do, o), q, kk, vv, o,
        lse.unsqueeze(-1), unused, unused, None, None, None, T, T, 0.0, causal, scale=scale,
    )
    if not grouped and rep > 1:  # summed in k's and v's own layouts: nothing copied below
        gk, gv = sum_groups(gk, rep, k), sum_groups(gv, rep, v)
    return _as_allocated(gq, q), _as_allocated(gk, k), _as_allocated(gv, v)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def agree(what: str, ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], tol: float = 2e-2) -> bool:
    """Whether cuDNN's results match the Triton kernels' (relative norm error of each below ``tol``;
    logsumexp, an fp32 statistic, to 1e-3). Warns once per disagreement, naming it."""
    errs = [_rel(a, b) for a, b in zip(theirs, ours, strict=True)]
    limits = [1e-3 if a.dtype == torch.float32 else tol for a in ours]
    if all(e <= lim for e, lim in zip(errs, limits, strict=True)):
        return True
    warnings.warn(f"cuDNN attention {what} disagrees with the Triton kernels (relative errors {errs}); "
                  f"mtc does not use it for this shape", stacklevel=3)
    return False


def warn_unavailable(what: str, err: Exception) -> None:
    """cuDNN attention raised on this problem: say so once (the other candidates carry on)."""
    warnings.warn(f"cuDNN attention {what} is unavailable here ({type(err).__name__}: {str(err)[:200]}); "
                  f"mtc does not use it for this shape", stacklevel=3)
