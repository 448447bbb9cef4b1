"""Second stage of column reductions: combine per-chunk fp32 partials into one row, in one launch.

Generated column kernels (kernels/codegen.py, ``column`` mode) split the rows of an (M, N)
reduction into chunks; each chunk writes an fp32 partial per column into a (SPLIT, N) buffer.
This kernel sums (or maxes) the SPLIT partials of each column in a fixed order (deterministic,
unlike atomics; tiles of many chunks at a time, see `_tiles`), applies the mean's 1/M, and casts
to the output dtype: one launch where torch would run three (``sum(0)``, the division, the cast),
and one for all of a kernel's outputs that combine alike. Norm weight and bias gradients of every
layer go through it (GPT-2's LayerNorm gradients took 0.1-0.2 ms each on the H100 with the
torch combine and a per-tile cross-warp reduction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtc.errors import KernelInputError

__all__ = ["combine_partials", "combine_partials_ref"]


@triton.jit
def _combine_kernel(part_ptr, out_ptr, SPLIT, N, scale, IS_MAX: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)  # which of the K outputs combined in this launch
    part_ptr += k * SPLIT * N
    out_ptr += k * N
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    rows = tl.arange(0, BLOCK_S)
    # [BLOCK_S, BLOCK] tiles: each lane folds the chunks s = lane (mod BLOCK_S) in order, then one
    # tree over the lanes: the same sum on every run, with BLOCK_S chunks' loads in flight at a time
    if IS_MAX:
        acc = tl.full([BLOCK_S, BLOCK], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_S, BLOCK], dtype=tl.float32)
    for s0 in range(0, SPLIT, BLOCK_S):
        r = s0 + rows
        m = (r[:, None] < SPLIT) & mask[None, :]
        ptrs = part_ptr + r[:, None].to(tl.int64) * N + cols[None, :]
        if IS_MAX:
            acc = tl.maximum(acc, tl.load(ptrs, mask=m, other=float("-inf")).to(tl.float32))
        else:
            acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    if IS_MAX:
        red = tl.max(acc, axis=0)
    else:
        red = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, (red * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(split: int, n: int, cuda: bool) -> tuple[int, int]:
    """(BLOCK_S, BLOCK): chunks and columns per tile. GPU: 4096-value tiles, tall where there are
    many chunks (a rowcol kernel's 4 per SM: 528 on an H100), so a narrow output still spreads
    over dozens of programs and each loops a few times (one 1024-column program per 1024 columns
    looping over 528 chunks one at a time took ~34 us per launch on the H200, 2026-11-27: five of
    them were 0.17 ms of GPT-2's 4.6 ms block). CPU interpreter: few, wide programs."""
    if not cuda:
        return min(64, triton.next_power_of_2(max(split, 1))), min(4096, triton.next_power_of_2(max(n, 1)))
    block_s = min(128, triton.next_power_of_2(max(split, 1)))
    return block_s, min(max(32, 4096 // block_s), triton.next_power_of_2(max(n, 1)))


def combine_partials(partials: torch.Tensor, how: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """(N,) of ``dtype``: the (SPLIT, N) fp32 ``partials`` combined by ``how`` ('sum', 'mean' over
    ``rows`` rows, or 'amax'), in a fixed order (the same result on every run). (K, SPLIT, N)
    partials give (K, N): K outputs combined the same way in one launch (a LayerNorm's weight and
    bias gradients)."""
    if partials.dim() not in (2, 3) or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise KernelInputError(f"combine_partials: expected contiguous fp32 (SPLIT, N) or (K, SPLIT, N) partials, got "
                               f"{partials.dtype} {tuple(partials.shape)}")
    if how not in ("sum", "mean", "amax"):
        raise KernelInputError(f"combine_partials: how must be 'sum', 'mean' or 'amax', got {how!r}")
    k, split, n = partials.shape if partials.dim() == 3 else (1, *partials.shape)
    shape = (k, n) if partials.dim() == 3 else (n,)
    if split == 1 and how != "mean" and dtype == torch.float32:
        return partials.reshape(shape)  # one chunk: the partial is the answer
    out = torch.empty(shape, dtype=dtype, device=partials.device)
    block_s, block = _tiles(split, n, partials.is_cuda)
    scale = 1.0 / rows if how == "mean" else 1.0
    _combine_kernel[(triton.cdiv(n, block), k)](partials, out, split, n, scale, IS_MAX=how == "amax", BLOCK=block,
                                                BLOCK_S=block_s)
    return out


def combine_partials_ref(partials: torch.Tensor, how: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch reference of `combine_partials`."""
    if how == "amax":
        return partials.amax(-2).to(dtype)
    s = partials.sum(-2)
    return (s / rows if how == "mean" else s).to(dtype)
