"""Flash attention, forward and backward, for (B, H, T, D) tensors with grouped KV heads.

softmax(q k^T * scale [+ causal mask]) v without the (T, T) matrix: the forward streams K/V
blocks past a block of queries with an online softmax and saves the row logsumexp (fp32); the
backward recomputes the probabilities from it. Query head h reads KV head h // (Hq // Hkv).

Backward design: two kernels after a small `delta = rowsum(dO * O)` pass. `_attn_bwd_dkdv_kernel`
owns one KV head's key block and loops over every query head of its group, so dK/dV sum over
the group in fp32 registers (no atomics, no (B, Hq, T, D) scratch); `_attn_bwd_dq_kernel` owns a
query block. Recomputing Q K^T in both costs one extra matmul per tile but keeps every write
exclusive, which a single fused kernel could only do with atomics on dQ.

Precision: statistics, softmax and every accumulator are fp32, and results are cast on store.
Matmul operands: fp16/bf16 inputs on CUDA stay in their dtype for the tensor cores (P and dS are
rounded to it before their matmuls, as in FlashAttention-2); fp32 inputs on CUDA use 3xTF32
(tensor cores, about fp32 accuracy). The Triton interpreter computes bf16 wrongly, so under it
every operand is cast to fp32 and multiplied exactly.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from mtc.kernels import cudnn_attention
from mtc.kernels.tuning import Decisions, Tuner

from mtc.errors import KernelInputError

__all__ = ["FlashAttentionFunction", "flash_attention", "flash_attention_ref", "has_choices", "recording",
           "seed_tuning", "tuning_choices", "tuning_seconds"]

_LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 128
_INT32_MAX = 2**31 - 1
# Kernels are interpreted iff this was set when they were defined (tests/conftest.py sets it).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, HALF_DOT: tl.constexpr):
    """a @ b accumulated in fp32: half operands as they are, fp32 ones as 3xTF32 (near-fp32 accuracy
    on the tensor cores; plain TF32 would lose ~3 digits, "ieee" spills registers at these tiles)."""
    if HALF_DOT:
        c = tl.dot(a, b)
    else:
        c = tl.dot(a, b, input_precision="tf32x3")
    return c


@triton.jit
def _operand(x, HALF_DOT: tl.constexpr):
    """A loaded tile as a matmul operand: kept in its half dtype, or cast to fp32."""
    if HALF_DOT:
        y = x
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _tile_mask(rows, T, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load/store mask of a (rows, BLOCK_D) tile: rows < T, and d < HEAD_DIM only if D is padded.
    A mask constant along D keeps the loads vectorized, which the software pipeliner needs."""
    if HEAD_DIM == BLOCK_D:
        mask = rows[:, None] < T
    else:
        mask = (rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_base, v_base,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, offs_d, T, qk_scale, lo, hi,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold key blocks [lo, hi) into the running (acc, l_i, m_i). MASKED blocks apply the causal
    mask (CAUSAL) or the T bound (not CAUSAL); the others lie wholly inside both."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = _tile_mask(offs_n, T, offs_d, HEAD_DIM, BLOCK_D)
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        k = _operand(k, HALF_DOT)
        v = _operand(v, HALF_DOT)
        qk = _dot(q, tl.trans(k), HALF_DOT) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            if CAUSAL:  # for rows < T, col <= row also keeps col < T
                qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
            else:
                qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        # every row sees key 0 in its first block, so m_ij is finite from the first step on
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_ij[:, None])
        alpha = tl.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, HALF_DOT)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, T, GROUP, qk_scale,
    CAUSAL: tl.constexpr, HALF_DOT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_M), B * H); the last query blocks (most causal work) start first
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_kh = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    k_base = k_ptr + off_b * stride_kb + off_kh * stride_kh
    v_base = v_ptr + off_b * stride_vb + off_kh * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = _tile_mask(offs_m, T, offs_d, HEAD_DIM, BLOCK_D)
    q_ptrs = q_ptr + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q = _operand(tl.load(q_ptrs, mask=q_mask, other=0.0), HALF_DOT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:  # keys left of the diagonal block are visible to every row; the diagonal is masked
        full_hi = start_m
        masked_hi = tl.minimum(start_m + BLOCK_M, T)
    else:  # whole key blocks unmasked, the ragged tail masked
        full_hi = (T // BLOCK_N) * BLOCK_N
        masked_hi = T
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, T, qk_scale, 0, full_hi,
        CAUSAL=CAUSAL, MASKED=False, HALF_DOT=HALF_DOT, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, T, qk_scale, full_hi, masked_hi,
        CAUSAL=CAUSAL, MASKED=True, HALF_DOT=HALF_DOT, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634  # natural-log logsumexp of the scaled scores
    o_ptrs = o_ptr + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + pid_bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, T,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_M), B * H); delta[b, h, t] = sum_d dO * O, the softmax-backward row term
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = _tile_mask(offs_m, T, offs_d, HEAD_DIM, BLOCK_D)
    o = tl.load(o_ptr + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base,
    stride_qt, stride_qd, stride_dot, stride_dod,
    offs_n, offs_d, T, qk_scale, lo, hi,
    MASKED: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Add query blocks [lo, hi) of one query head to this key block's dK (unscaled) and dV.

    Rows >= T load q = dO = lse = delta = 0, so their P^T is 1 but dO = 0 and dP - delta = 0:
    they add exactly nothing. Key rows >= T are never stored. Only the causal diagonal needs a mask.
    """
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        mask = _tile_mask(offs_m, T, offs_d, HEAD_DIM, BLOCK_D)
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
        q = _operand(q, HALF_DOT)
        do = _operand(do, HALF_DOT)
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        qk_t = _dot(k, tl.trans(q), HALF_DOT) * qk_scale  # (BLOCK_N, BLOCK_M): scores transposed
        if MASKED:  # key n is seen by query m only if m >= n
            qk_t = tl.where(offs_m[None, :] >= offs_n[:, None], qk_t, float("-inf"))
        p_t = tl.exp2(qk_t - lse2[None, :])
        dv += _dot(p_t.to(do.dtype), do, HALF_DOT)
        dp_t = _dot(v, tl.trans(do), HALF_DOT)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, HALF_DOT)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    H, H_KV, T, GROUP, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, HALF_DOT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_N), B * H_KV); the first key blocks (most causal work) start first
    start_n = tl.program_id(0) * BLOCK_N
    pid_bkh = tl.program_id(1)
    b = pid_bkh // H_KV
    kh = pid_bkh % H_KV
    off_b = b.to(tl.int64)
    off_kh = kh.to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = _tile_mask(offs_n, T, offs_d, HEAD_DIM, BLOCK_D)
    k = tl.load(k_ptr + off_b * stride_kb + off_kh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + off_b * stride_vb + off_kh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    k = _operand(k, HALF_DOT)
    v = _operand(v, HALF_DOT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):  # the group's query heads, summed here in fp32
        h = kh * GROUP + g
        off_h = h.to(tl.int64)
        q_base = q_ptr + off_b * stride_qb + off_h * stride_qh
        do_base = do_ptr + off_b * stride_dob + off_h * stride_doh
        row_base = (b * H + h).to(tl.int64) * T
        if CAUSAL:  # the diagonal block (masked), then every later query block (all visible)
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d, T, qk_scale,
                start_n, tl.minimum(start_n + BLOCK_N, T),
                MASKED=True, HALF_DOT=HALF_DOT, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            )
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d, T, qk_scale,
                start_n + BLOCK_N, T,
                MASKED=False, HALF_DOT=HALF_DOT, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            )
        else:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d, T, qk_scale,
                0, T,
                MASKED=False, HALF_DOT=HALF_DOT, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            )
    dk = dk * sm_scale
    dk_ptrs = dk_ptr + off_b * stride_dkb + off_kh * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    dv_ptrs = dv_ptr + off_b * stride_dvb + off_kh * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, offs_d, T, qk_scale, lo, hi,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Add key blocks [lo, hi) to this query block's dQ (unscaled); masks as in the forward."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = _tile_mask(offs_n, T, offs_d, HEAD_DIM, BLOCK_D)
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        k = _operand(k, HALF_DOT)
        v = _operand(v, HALF_DOT)
        qk = _dot(q, tl.trans(k), HALF_DOT) * qk_scale
        if MASKED:
            if CAUSAL:
                qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
            else:
                qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        p = tl.exp2(qk - lse2[:, None])
        dp = _dot(do, tl.trans(v), HALF_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, HALF_DOT)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, T, GROUP, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, HALF_DOT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(T, BLOCK_M), B * H), last query blocks first as in the forward
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_kh = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    k_base = k_ptr + off_b * stride_kb + off_kh * stride_kh
    v_base = v_ptr + off_b * stride_vb + off_kh * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    mask = _tile_mask(offs_m, T, offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=mask, other=0.0)
    do = tl.load(do_ptr + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    q = _operand(q, HALF_DOT)
    do = _operand(do, HALF_DOT)
    row_base = pid_bh.to(tl.int64) * T
    lse2 = tl.load(lse_ptr + row_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=row_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        full_hi = start_m
        masked_hi = tl.minimum(start_m + BLOCK_M, T)
    else:
        full_hi = (T // BLOCK_N) * BLOCK_N
        masked_hi = T
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, T, qk_scale, 0, full_hi,
        CAUSAL=CAUSAL, MASKED=False, HALF_DOT=HALF_DOT, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, T, qk_scale, full_hi, masked_hi,
        CAUSAL=CAUSAL, MASKED=True, HALF_DOT=HALF_DOT, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )
    dq = dq * sm_scale
    dq_ptrs = dq_ptr + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, the first one the default.
# Query-block kernels ("fwd", "dq") need BLOCK_M % BLOCK_N == 0 and "dkdv" BLOCK_N % BLOCK_M == 0,
# so the causal diagonal covers whole blocks. The first CUDA entries were picked by compiling for
# sm_90 (Triton 3.9): at D = 128 no or few bytes of register spill (fwd 0, dkdv 28 B) and at most
# 160 KB of shared memory; larger half tiles spill in dkdv, larger fp32 tiles spill everywhere.
# The others are candidates, not promises: Triton 3.9 spills 76-572 B in fwd (128, 32) and dkdv
# (64, 128) and (32, 64) at D = 128 (a CPU compile of every kernel of bench_fusion's real parts,
# 2026-11-27), yet the H100 and H200 runs (Triton 3.6) chose dkdv (32, 64, 4, 3) as fastest. On
# CUDA the first launch per shape times every candidate (kernels/tuning.py) and keeps the fastest; a
# compiled plan makes those first launches at compile time and stores the choices
# (kernels/attention_tuning.py).
_TILES = {
    "cuda_half": {
        "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)],
        "dq": [(128, 32, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
        "dkdv": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (16, 128, 8, 2)],
    },
    "cuda_fp32": {
        "fwd": [(32, 32, 4, 2), (64, 32, 4, 2)],
        "dq": [(32, 32, 8, 2), (32, 32, 4, 2)],
        "dkdv": [(32, 32, 8, 2), (32, 64, 8, 2)],
    },
    # the interpreter runs one numpy op per tile op: small tiles, same shape ratios as on CUDA
    "interpreter": {"fwd": [(32, 16, 1, 1)], "dq": [(32, 16, 1, 1)], "dkdv": [(16, 32, 1, 1)]},
}
_TUNER = Tuner("flash_attention")


def _tiles(q: torch.Tensor) -> str:
    if not q.is_cuda:
        return "interpreter"
    return "cuda_fp32" if q.dtype == torch.float32 else "cuda_half"


def _config_list(q: torch.Tensor, kernel: str) -> list[dict]:
    """Candidate launch configurations of one kernel ("fwd", "dq" or "dkdv"), the default first.

    HALF_DOT: fp16/bf16 on CUDA feed the tensor cores in their own dtype; otherwise operands are
    fp32 (3xTF32 on CUDA, exact in the interpreter, which computes bf16 wrongly).
    """
    tiles = _tiles(q)
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "HALF_DOT": tiles == "cuda_half", "num_warps": w, "num_stages": st}
        for m, n, w, st in _TILES[tiles][kernel]
    ]


def _config(q: torch.Tensor, kernel: str, key: tuple, launch: Callable[[dict], None], extra: tuple = ()) -> dict:
    """The fastest of ``_config_list(q, kernel)`` (and ``extra`` candidates) for this problem
    ``key``, timed with ``launch(config)`` on first use."""
    return _TUNER.choose((kernel, _tiles(q), *key), _config_list(q, kernel) + list(extra), launch)


def _cudnn_candidate(q: torch.Tensor) -> bool:
    return not _INTERPRETED and cudnn_attention.usable(q)


def _cudnn_extra(q: torch.Tensor, k: torch.Tensor) -> list[dict]:
    """cuDNN's forward candidates: KV heads repeated per query group (``{"BACKEND": "cudnn"}``, the
    only way when there is no grouping), and with grouped KV heads also handed over as they are."""
    if not _cudnn_candidate(q):
        return []
    return [{"BACKEND": "cudnn"}] + ([{"BACKEND": "cudnn", "GQA": True}] if q.shape[1] != k.shape[1] else [])


def _backends(q: torch.Tensor, k: torch.Tensor) -> list[str]:
    """Backward candidates: Triton, and cuDNN's ways as in `_cudnn_extra` ("cudnn", "cudnn_gqa")."""
    return ["triton"] + ["cudnn_gqa" if c.get("GQA") else "cudnn" for c in _cudnn_extra(q, k)]


def _cudnn_what(direction: str, cand: dict | str) -> str:
    """How warnings name a cuDNN candidate."""
    grouped = cand == "cudnn_gqa" or (isinstance(cand, dict) and cand.get("GQA"))
    return f"{direction} (grouped KV heads)" if grouped else direction


def has_choices(q: torch.Tensor) -> bool:
    """Whether attention on tensors like ``q`` (its device, dtype and head dim; it may be empty)
    has anything to time: several tile candidates for a kernel, or cuDNN as a second backend."""
    return _cudnn_candidate(q) or any(len(c) > 1 for c in _TILES[_tiles(q)].values())


def tuning_choices() -> dict[str, object]:
    """What the first launches chose per problem (tile configs, "cudnn" or "triton" backward), readable."""
    return {"/".join(map(str, k)): v for k, v in _TUNER.best.items()}


def seed_tuning(decisions: Decisions) -> None:
    """Take a compiled plan's recorded choices: their shapes launch without timing."""
    _TUNER.seed(decisions)


def recording() -> contextlib.AbstractContextManager[Decisions]:
    """A context collecting the choices the attention launches inside it use (see `Tuner.recording`)."""
    return _TUNER.recording()


def tuning_seconds() -> float:
    """Seconds this process has spent timing attention candidates."""
    return _TUNER.seconds


_MAX_GRID_Y = 65535


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> float:
    """Raise KernelInputError unless q, k, v can go to the kernels; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise KernelInputError(f"flash_attention: {name} must be 4-D (B, H, T, D), got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise KernelInputError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.is_cuda or (q.device.type == "cpu" and _INTERPRETED)):
        raise KernelInputError(
            f"flash_attention: tensors must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1 set "
            f"before mtc.kernels is imported), got {q.device}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise KernelInputError(
            f"flash_attention: q, k, v must share one dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    B, Hq, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise KernelInputError(
            f"flash_attention: expected q (B, Hq, T, D) and k, v (B, Hkv, T, D); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise KernelInputError(
            f"flash_attention: query heads ({Hq}) must be a multiple of KV heads ({Hkv}) for grouped-query attention"
        )
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise KernelInputError(f"flash_attention: head dim must be in 1..{_MAX_HEAD_DIM}, got {D}")
    if B * Hq > _MAX_GRID_Y:  # the kernels' grid: (query blocks, B * H); CUDA caps a grid's y at 65535
        raise KernelInputError(f"flash_attention: batch x query heads is {B} x {Hq} = {B * Hq}, over the kernels' "
                               f"limit of {_MAX_GRID_Y}; use fewer sequences per micro-batch")
    for name, t in (("q", q), ("k", k), ("v", v)):  # offsets inside one (T, D) head are int32
        if (T - 1) * abs(t.stride(2)) + (D - 1) * abs(t.stride(3)) > _INT32_MAX:
            raise KernelInputError(
                f"flash_attention: {name}'s (T, D) slice spans more than 2**31 elements (strides {t.stride()}); "
                f"make it contiguous"
            )
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise KernelInputError(f"flash_attention: scale must be finite, got {scale}")
    return scale


def _flash_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs -> (o (B, Hq, T, D) in q's dtype, lse (B, Hq, T) fp32, natural log). o is laid out
    as ``torch.empty_like(q)`` (q's dim order, dense; cuDNN allocates its output the same way): when
    q is a (B, T, Hq, D) buffer seen as (B, Hq, T, D), so is o, and the graph's transpose back to
    (B, T, Hq * D) for the output projection is a view, not a copy."""
    B, H, T, D = q.shape
    key = _tuning_key(q, k, causal)
    cfg = _TUNER.recall(("fwd", _tiles(q), *key), _config_list(q, "fwd") + _cudnn_extra(q, k))
    if cfg is not None and cfg.get("BACKEND") == "cudnn" and q.numel():
        # cuDNN's own output buffers, as they are: no copy into ours
        return cudnn_attention.forward(q, k, v, causal, scale, grouped=bool(cfg.get("GQA")))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    def launch(cfg: dict) -> None:  # idempotent: timing candidates just rewrites o and lse
        if cfg.get("BACKEND") == "cudnn":
            got = cudnn_attention.forward(q, k, v, causal, scale, grouped=bool(cfg.get("GQA")))
            o.copy_(got[0])
            lse.copy_(got[1])
            return
        _attn_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            H, T, H // k.shape[1], scale * _LOG2E,
            CAUSAL=bool(causal), HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), **cfg,
        )

    def timed(cfg: dict) -> None:  # what a call with ``cfg`` runs: cuDNN's outputs as they are (no copy into ours)
        if cfg.get("BACKEND") == "cudnn":
            cudnn_attention.forward(q, k, v, causal, scale, grouped=bool(cfg.get("GQA")))
        else:
            launch(cfg)

    if cfg is None:
        extra: list[dict] = []
        if _cudnn_candidate(q):
            # first call for this shape: each cuDNN way competes only if it computes what the Triton kernel does
            launch(_config_list(q, "fwd")[0])
            ours = (o.clone(), lse.clone())
            for cand in _cudnn_extra(q, k):
                try:
                    launch(cand)
                    if cudnn_attention.agree(_cudnn_what("forward", cand), ours, (o, lse)):
                        extra.append(cand)
                except Exception as e:  # noqa: BLE001  (this torch / cuDNN cannot take the problem: keep Triton)
                    cudnn_attention.warn_unavailable(_cudnn_what("forward", cand), e)
        cfg = _config(q, "fwd", key, timed, tuple(extra))
        if cfg.get("BACKEND") == "cudnn":
            return cudnn_attention.forward(q, k, v, causal, scale, grouped=bool(cfg.get("GQA")))
    launch(cfg)
    return o, lse


def _tuning_key(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple:
    """What the best tiles depend on: sizes, grouping, masking, dtype (fp16 and bf16 share tiles, not
    cuDNN's agreement with them); strides rarely change in a run."""
    B, H, T, D = q.shape
    return (B * H, k.shape[1] * B, T, D, bool(causal), str(q.dtype).removeprefix("torch."))


def _flash_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in the inputs' dtypes; dk, dv summed over each KV head's query group."""
    B, H, T, D = q.shape
    H_KV = k.shape[1]
    do = do.to(q.dtype)  # autograd may hand a grad of another dtype; the half matmuls need q's
    key = _tuning_key(q, k, causal)
    bkey = ("bwd_backend", str(q.dtype), *key)
    backend = _TUNER.recall(bkey, _backends(q, k))
    if backend is not None and backend.startswith("cudnn") and q.numel():
        # cuDNN's own gradient buffers, as they are (when laid out as ours would be): no copies
        return cudnn_attention.backward(do, q, k, v, o, lse, causal, scale, grouped=backend == "cudnn_gqa")
    # gradients take their input's layout (as autograd's do), so graphs traced against the
    # reference op can view them the same way; the kernels write through any strides
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    block_d = max(16, triton.next_power_of_2(D))
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)

    def preprocess() -> None:
        _attn_bwd_preprocess_kernel[(triton.cdiv(T, 64), B * H)](
            o, do, delta, *o.stride(), *do.stride(), H, T, HEAD_DIM=D, BLOCK_M=64, BLOCK_D=block_d, num_warps=4,
        )

    def launch_dkdv(cfg: dict) -> None:  # idempotent: writes dk, dv
        _attn_bwd_dkdv_kernel[(triton.cdiv(T, cfg["BLOCK_N"]), B * H_KV)](
            q, k, v, do, dk, dv, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            H, H_KV, T, H // H_KV, scale * _LOG2E, scale,
            CAUSAL=bool(causal), HEAD_DIM=D, BLOCK_D=block_d, **cfg,
        )

    def launch_dq(cfg: dict) -> None:  # idempotent: writes dq
        _attn_bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, do, dq, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
            H, T, H // H_KV, scale * _LOG2E, scale,
            CAUSAL=bool(causal), HEAD_DIM=D, BLOCK_D=block_d, **cfg,
        )

    def run(backend: str) -> None:  # idempotent: writes dq, dk, dv
        if backend.startswith("cudnn"):
            for mine, got in zip((dq, dk, dv), cudnn_attention.backward(do, q, k, v, o, lse, causal, scale,
                                                                        grouped=backend == "cudnn_gqa"), strict=True):
                mine.copy_(got)
            return
        preprocess()
        launch_dkdv(_config(q, "dkdv", key, launch_dkdv))
        launch_dq(_config(q, "dq", key, launch_dq))

    def timed(backend: str) -> None:  # what a call with ``backend`` runs: cuDNN's gradients as they are (no copies)
        if backend.startswith("cudnn"):
            cudnn_attention.backward(do, q, k, v, o, lse, causal, scale, grouped=backend == "cudnn_gqa")
        else:
            run(backend)

    if backend is None:
        # first call for this shape: tune the Triton tiles, then let each cuDNN way compete if it agrees
        run("triton")
        backends, cands = ["triton"], _backends(q, k)[1:]
        ours = (dq.clone(), dk.clone(), dv.clone()) if cands else ()  # what each cuDNN way must agree with
        for cand in cands:
            try:
                run(cand)
                if cudnn_attention.agree(_cudnn_what("backward", cand), ours, (dq, dk, dv)):
                    backends.append(cand)
            except Exception as e:  # noqa: BLE001  (this torch / cuDNN cannot take the problem: keep Triton)
                cudnn_attention.warn_unavailable(_cudnn_what("backward", cand), e)
        backend = _TUNER.choose(bkey, backends, timed)
        if backend.startswith("cudnn"):
            return cudnn_attention.backward(do, q, k, v, o, lse, causal, scale, grouped=backend == "cudnn_gqa")
    run(backend)
    return dq, dk, dv


# Custom ops so torch.compile / export trace the launchers as opaque nodes with known output
# shapes instead of tracing into Triton. No device_types: CPU (interpreter) tests call them too.
@torch.library.custom_op("mtc::flash_attention_fwd", mutates_args=())
def _flash_attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, scale)  # compiled graphs call the op directly, not `flash_attention`
    return _flash_attn_fwd(q, k, v, causal, scale)


@_flash_attention_fwd_op.register_fake
def _(q, k, v, causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("mtc::flash_attention_bwd", mutates_args=())
def _flash_attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, scale)
    return _flash_attn_bwd(do, q, k, v, o, lse, causal, scale)


@_flash_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttentionFunction(torch.autograd.Function):
    """flash_attention(q, k, v, causal=True, scale=None) -> o

    q (B, Hq, T, D), k and v (B, Hkv, T, D) with Hq % Hkv == 0, any strides, one dtype of float16,
    bfloat16 or float32, D <= 128. Returns softmax(q k^T * scale [+ causal mask]) v, (B, Hq, T, D)
    in q's dtype; scale defaults to 1/sqrt(D). Saves q, k, v, o and the fp32 logsumexp for backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool = True, scale: float | None = None):
        scale = _check_inputs(q, k, v, scale)
        o, lse = _flash_attention_fwd_op(q, k, v, bool(causal), scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = bool(causal), scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _flash_attention_bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v with grouped KV heads; see `FlashAttentionFunction`.
    (A function, not ``FlashAttentionFunction.apply``: torch 2.11's apply takes no keywords.)"""
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def flash_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """The same attention in plain torch, in fp32 with the full (T, T) matrix; returns q's dtype."""
    rep = q.shape[1] // k.shape[1]
    qf = q.float()
    kf = k.float().repeat_interleave(rep, dim=1)  # (B, Hq, T, D): query head h reads KV head h // rep
    vf = v.float().repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (qf @ kf.transpose(-1, -2)) * scale  # (B, Hq, T, T)
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)
