"""Grouped KV heads to per-query-head tensors and back, for attention backends that take no groups.

With grouped-query attention, query head h reads KV head h // rep. A backend that wants one KV
head per query head (cuDNN's, as torch's SDPA calls it: the `cudnn` candidate of
`kernels/cudnn_attention.py`) needs K and V repeated per group, and hands back gradients per
query head that must be summed over each group. Done with torch ops, that took several passes
through generic strided kernels: on the H200, Qwen2-7B's block (8192 tokens, 28 query heads over
4 KV heads, D 128), whose backward took this way, spent 0.20 ms per call in four non-vectorised
copies (``repeat_interleave``'s expand-and-clone of K and V, and, by their count, the summed
gradients copied into K's and V's (B, T, H, D) layout) and 0.07 ms in two reductions
(bench_fusion profile, records of 2026-11-27).

`expand_heads` writes the repeated heads in one pass, straight into the layout of the query
tensor they sit beside (so the backend sees q, k and v alike); `sum_groups` sums each group's
gradients in fp32 and writes them once, in K's own layout, so nothing is copied afterwards. Both
read and write through any strides. `expand_heads_ref` and `sum_groups_ref` are the pure-torch
definitions the tests hold them to; off CUDA (and outside the Triton interpreter) the functions
are those references.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["expand_heads", "expand_heads_ref", "sum_groups", "sum_groups_ref"]

# Kernels are interpreted iff this was set when they were defined (tests/conftest.py sets it).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_T = 64  # rows (positions) per program: with D 128, 8192 elements, 16 KiB of bf16


@triton.jit
def _regroup_heads(
    src_ptr, dst_ptr,
    s_b, s_h, s_t, s_d, d_b, d_h, d_t, d_d,
    H_OUT, T, DIV, MUL, N,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_T), B * H_OUT); output head j of batch b is the fp32 sum of source heads
    # (j // DIV) * MUL + r for r < N, cast on store (one term: an exact copy in any of the dtypes)
    pid = tl.program_id(1)
    b = (pid // H_OUT).to(tl.int64)
    j = (pid % H_OUT).to(tl.int64)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    if HEAD_DIM == BLOCK_D:  # a mask constant along D keeps the loads and stores vectorised
        mask = offs_t[:, None] < T
    else:
        mask = (offs_t[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    src = src_ptr + b * s_b + (j // DIV) * MUL * s_h + offs_t[:, None] * s_t + offs_d[None, :] * s_d
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for r in range(0, N):
        acc += tl.load(src + r * s_h, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + b * d_b + j * d_h + offs_t[:, None] * d_t + offs_d[None, :] * d_d,
             acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_heads_kernel(
    src_ptr, dst_ptr,
    s_b, s_h, s_t, s_d, d_b, d_h, d_t, d_d,
    H, T, REP,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # query head h is KV head h // REP. Consecutive programs of one head walk its positions, and the
    # REP heads of a group follow each other, so the group's reads after the first come from L2.
    _regroup_heads(src_ptr, dst_ptr, s_b, s_h, s_t, s_d, d_b, d_h, d_t, d_d, H, T, REP, 1, 1,
                   HEAD_DIM, BLOCK_T, BLOCK_D)


@triton.jit
def _sum_groups_kernel(
    src_ptr, dst_ptr,
    s_b, s_h, s_t, s_d, d_b, d_h, d_t, d_d,
    HKV, T, REP,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # KV head g sums query heads g * REP .. g * REP + REP - 1
    _regroup_heads(src_ptr, dst_ptr, s_b, s_h, s_t, s_d, d_b, d_h, d_t, d_d, HKV, T, 1, REP, REP,
                   HEAD_DIM, BLOCK_T, BLOCK_D)


def expand_heads_ref(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``t`` (B, Hkv, T, D) with each head repeated ``rep`` times in place: (B, Hkv * rep, T, D)."""
    return t.repeat_interleave(rep, dim=1)


def sum_groups_ref(g: torch.Tensor, rep: int) -> torch.Tensor:
    """``g`` (B, Hkv * rep, T, D) summed over each run of ``rep`` heads (fp32 sums): (B, Hkv, T, D)."""
    return g.unflatten(1, (g.shape[1] // rep, rep)).float().sum(2).to(g.dtype)


def _check(t: torch.Tensor, rep: int, what: str) -> None:
    if t.dim() != 4:
        raise ValueError(f"{what}: expected a (B, H, T, D) tensor, got shape {tuple(t.shape)}")
    if rep < 1:
        raise ValueError(f"{what}: rep must be at least 1, got {rep}")


def _launch(kernel: triton.JITFunction, src: torch.Tensor, dst: torch.Tensor, heads: int, rep: int) -> None:
    B, _, T, D = dst.shape
    if dst.numel() == 0:
        return
    kernel[(triton.cdiv(T, _BLOCK_T), B * heads)](
        src, dst, *src.stride(), *dst.stride(), heads, T, rep,
        HEAD_DIM=D, BLOCK_T=_BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4,
    )


def _kernels_run(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRETED and t.device.type == "cpu")


def expand_heads(t: torch.Tensor, rep: int, like: torch.Tensor) -> torch.Tensor:
    """`expand_heads_ref` of ``t`` (B, Hkv, T, D) laid out as ``torch.empty_like(like)``, where
    ``like`` is (B, Hkv * rep, T, D) (the query tensor): one pass, any strides on either side."""
    _check(t, rep, "expand_heads")
    B, Hkv, T, D = t.shape
    if tuple(like.shape) != (B, Hkv * rep, T, D):
        raise ValueError(f"expand_heads: like must have shape {(B, Hkv * rep, T, D)}, got {tuple(like.shape)}")
    out = torch.empty_like(like, dtype=t.dtype)
    if not _kernels_run(t):
        return out.copy_(expand_heads_ref(t, rep))
    _launch(_expand_heads_kernel, t, out, Hkv * rep, rep)
    return out


def sum_groups(g: torch.Tensor, rep: int, like: torch.Tensor) -> torch.Tensor:
    """`sum_groups_ref` of ``g`` (B, Hkv * rep, T, D) laid out as ``torch.empty_like(like)``, where
    ``like`` is (B, Hkv, T, D) (the KV tensor whose gradient this is): fp32 sums, one write."""
    _check(g, rep, "sum_groups")
    B, H, T, D = g.shape
    if H % rep or tuple(like.shape) != (B, H // rep, T, D):
        raise ValueError(f"sum_groups: {H} heads do not form groups of {rep} matching like's shape {tuple(like.shape)}")
    out = torch.empty_like(like, dtype=g.dtype)
    if not _kernels_run(g):
        return out.copy_(sum_groups_ref(g, rep))
    _launch(_sum_groups_kernel, g, out, H // rep, rep)
    return out
