"""A Triton matmul with a fused norm prologue and a bias / activation / residual epilogue.

``fused_mm(a, b, ...) = residual + act(norm(a) @ b + bias)`` for 2-D operands of any strides:

* prologue (optional): the rows of ``a`` (or, ``norm_on_b``, of ``b``: the weight gradient's
  ``dy^T @ xn``) are normalised while they are loaded,
  ``((a - mean[m]) * rstd[m]) * norm_w[k] + norm_b[k]`` (RMSNorm: no mean, no norm_b), cast to the
  matmul's operand dtype (what ATen's normalised tensor would hold) before the dot. The per-row
  statistics come from a cheap pre-pass (the norm's own row kernel, which then writes two floats
  per row instead of the whole normalised tensor). ``round_norm`` rounds ``(a - mean) * rstd`` to
  the operand dtype before the weight multiply, as Llama's ``hidden.to(input_dtype) * weight`` does;
* epilogue (optional): bias per column, an activation (``gelu``, ``gelu_tanh``, ``silu``,
  ``relu``), a residual (M, N) added last; each step rounds to the output dtype as the separate
  ATen ops would (a no-op in fp32): the product (with its bias) as mm / addmm stores it, the
  activation's result, the sum.

``fused_mm_pre`` (op ``mtc::fused_mm_pre``) is the same kernel writing the product as well:
``(pre, post) = (norm(a) @ b + bias, residual + act(pre))``. Training graphs save the
pre-activation for the backward (GELU's and SiLU's derivatives read it), so the matmul writes it
anyway; unfused, a separate activation kernel then reads it back and writes ``post``. Fused, the
epilogue stores both from registers and that read goes away (and a launch): M x N elements per
site and joint-graph call (the backward visit recomputes the layer), e.g. 8192 tokens through
GPT-2 small's c_fc (N = 3072): 48 MiB in bf16, 96 MiB in fp32. It pays only where ``post`` is
written anyway (GPT-2's GELU feeds c_proj, a matmul). Llama's gated SiLU is not such a site: only
the gating multiply's generated kernel reads it, computing it on the fly from the gate, so
fusing it would add a write of M x N (8192 x 14336 for Llama-8B: 224 MiB in bf16), not save one.

Accumulation is fp32 (``tl.dot``); fp32 operands multiply in IEEE fp32 unless torch allows TF32.
The ops appear only in lowered graphs (kernels/matmul_fusion.py puts them there), forward and
joint, whose backward is already explicit ATen: they need no autograd formula of their own.
``fused_mm_ref`` and ``fused_mm_pre_ref`` are the same computations in torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mtc.errors import KernelInputError

__all__ = ["ACTIVATIONS", "fused_mm", "fused_mm_pre", "fused_mm_pre_ref", "fused_mm_ref"]

ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "relu": 4}
_INTERPRETED = not torch.cuda.is_available()


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _fused_mm_kernel(
    a_ptr, b_ptr, c_ptr, pre_ptr, bias_ptr, res_ptr, mean_ptr, rstd_ptr, nw_ptr, nb_ptr,
    M, N, K,
    s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_pm, s_pn, s_rm, s_rn, s_mean, s_rstd,
    WRITE_PRE: tl.constexpr, NORM: tl.constexpr, NORM_B: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr,
    ROUND_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped program order: GROUP_M row blocks share each column block of b while it is in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    op_ty = b_ptr.dtype.element_ty  # the matmul's operand dtype (ATen's normalised tensor holds it)
    if NORM and not NORM_B:
        rstd = tl.load(rstd_ptr + rm * s_rstd, mask=mmask, other=0.0).to(tl.float32)
        if HAS_MEAN:
            mean = tl.load(mean_ptr + rm * s_mean, mask=mmask, other=0.0).to(tl.float32)
    if NORM and NORM_B:  # b's rows are the normalised rows: per-row terms by k, per-column by n
        if HAS_NW:
            nw = tl.load(nw_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        if HAS_NB:
            nb = tl.load(nb_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        kmask = rk < K
        amask = mmask[:, None] & kmask[None, :]
        bmask = kmask[:, None] & nmask[None, :]
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=amask, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=bmask, other=0.0)
        if NORM and not NORM_B:
            x = a.to(tl.float32)
            if HAS_MEAN:
                x = x - mean[:, None]
            x = x * rstd[:, None]
            if ROUND_NORM:
                x = x.to(op_ty).to(tl.float32)
            if HAS_NW:
                x = x * tl.load(nw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if HAS_NB:
                x = x + tl.load(nb_ptr + rk, mask=kmask, other=0.0).to(tl.float32)[None, :]
            a = tl.where(amask, x, 0.0).to(op_ty)  # padding lanes stay 0 (the norm bias would fill them)
        if NORM and NORM_B:
            x = b.to(tl.float32)
            rs = tl.load(rstd_ptr + rk * s_rstd, mask=kmask, other=0.0).to(tl.float32)
            if HAS_MEAN:
                x = x - tl.load(mean_ptr + rk * s_mean, mask=kmask, other=0.0).to(tl.float32)[:, None]
            x = x * rs[:, None]
            if ROUND_NORM:
                x = x.to(op_ty).to(tl.float32)
            if HAS_NW:
                x = x * nw[None, :]
            if HAS_NB:
                x = x + nb[None, :]
            b = tl.where(bmask, x, 0.0).to(op_ty)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out_ty = c_ptr.dtype.element_ty
    cmask = mmask[:, None] & nmask[None, :]
    c = acc
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    # the activation reads the product as mm / addmm stores it (a no-op in fp32)
    c = c.to(out_ty).to(tl.float32)
    if WRITE_PRE:
        tl.store(pre_ptr + rm[:, None] * s_pm + rn[None, :] * s_pn, c.to(out_ty), mask=cmask)
    if ACT == 1:
        c = 0.5 * c * (1.0 + tl.erf(c * 0.7071067811865476))
    elif ACT == 2:
        c = 0.5 * c * (1.0 + (2.0 * _sigmoid(2.0 * (0.7978845608028654 * (c + 0.044715 * c * c * c))) - 1.0))
    elif ACT == 3:
        c = c * _sigmoid(c)
    elif ACT == 4:
        c = tl.maximum(c, 0.0)
    if ACT != 0:
        c = c.to(out_ty).to(tl.float32)
    if HAS_RES:
        c = c + tl.load(res_ptr + rm[:, None] * s_rm + rn[None, :] * s_rn, mask=cmask, other=0.0).to(tl.float32)
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, c.to(out_ty), mask=cmask)


def _tiles(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Launch tiles: one fixed configuration per device class (GEMM speed is not tuned here: the
    fusion is chosen only where it beats cuBLAS + a separate kernel, see kernels/matmul_fusion.py)."""
    if not a.is_cuda:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4}  # interpreter: few, wide steps
    if b.dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def _check(a: torch.Tensor, b: torch.Tensor, named: dict[str, torch.Tensor | None], act: str, norm_on_b: bool) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise KernelInputError(f"fused_mm: expected a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if act not in ACTIVATIONS:
        raise KernelInputError(f"fused_mm: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if not b.dtype.is_floating_point or not a.dtype.is_floating_point:
        raise KernelInputError(f"fused_mm: floating operands needed, got {a.dtype} and {b.dtype}")
    M, N = a.shape[0], b.shape[1]
    rows, cols = (b.shape[0], N) if norm_on_b else (M, a.shape[1])  # the normalised operand's rows and columns
    want = {"bias": (N,), "residual": (M, N), "mean": (rows,), "rstd": (rows,), "norm_w": (cols,), "norm_b": (cols,)}
    for name, t in named.items():
        if t is None:
            continue
        if t.device != a.device or b.device != a.device:
            raise KernelInputError(f"fused_mm: {name} is on {t.device}, the operands on {a.device} and {b.device}")
        if math.prod(t.shape) != math.prod(want[name]) or (name == "residual" and tuple(t.shape) != want[name]):
            raise KernelInputError(f"fused_mm: {name} has shape {tuple(t.shape)}, expected {want[name]}")
    if named["rstd"] is None and any(named[k] is not None for k in ("mean", "norm_w", "norm_b")):
        raise KernelInputError("fused_mm: a norm prologue needs rstd (mean, norm_w and norm_b are optional)")


def _flat(t: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """A per-row or per-column vector as 1-D with its stride (a (B, T, 1) statistic reshapes to a view)."""
    if t is None:
        return None, 0
    v = t.reshape(-1)
    return v, v.stride(0)


def _launch(
    a: torch.Tensor, b: torch.Tensor, write_pre: bool, bias: torch.Tensor | None,
    residual: torch.Tensor | None, mean: torch.Tensor | None, rstd: torch.Tensor | None,
    norm_w: torch.Tensor | None, norm_b: torch.Tensor | None, act: str, round_norm: bool, norm_on_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the inputs and run the kernel: the (M, N) result and, with ``write_pre``, the product
    before the activation."""
    _check(a, b, {"bias": bias, "residual": residual, "mean": mean, "rstd": rstd, "norm_w": norm_w, "norm_b": norm_b},
           act, norm_on_b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=b.dtype, device=a.device)
    pre = torch.empty_like(c) if write_pre else None
    if M == 0 or N == 0:
        return c, pre
    mean_v, s_mean = _flat(mean)
    rstd_v, s_rstd = _flat(rstd)
    dummy = c  # never read or written: its HAS_* / WRITE_PRE flag is off
    cfg = _tiles(a, b)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    ieee = b.dtype == torch.float32 and not (a.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    _fused_mm_kernel[grid](
        a, b, c, pre if pre is not None else dummy, bias if bias is not None else dummy,
        residual if residual is not None else dummy,
        mean_v if mean_v is not None else dummy, rstd_v if rstd_v is not None else dummy,
        norm_w if norm_w is not None else dummy, norm_b if norm_b is not None else dummy,
        M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        pre.stride(0) if pre is not None else 0, pre.stride(1) if pre is not None else 0,
        residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
        s_mean, s_rstd,
        WRITE_PRE=pre is not None,
        NORM=rstd is not None, NORM_B=bool(norm_on_b), HAS_MEAN=mean is not None, HAS_NW=norm_w is not None, HAS_NB=norm_b is not None,
        ROUND_NORM=bool(round_norm), HAS_BIAS=bias is not None, ACT=ACTIVATIONS[act], HAS_RES=residual is not None,
        IEEE=ieee, **cfg,
    )
    return c, pre


def fused_mm(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
    norm_b: torch.Tensor | None = None, act: str = "none", round_norm: bool = False, norm_on_b: bool = False,
) -> torch.Tensor:
    """``residual + act(norm(a) @ b + bias)`` in one kernel, (M, N) of ``b``'s dtype (see module doc);
    with ``norm_on_b`` the prologue normalises the rows of ``b`` instead: ``a @ norm(b)``."""
    return _launch(a, b, False, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b)[0]


def fused_mm_pre(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
    norm_b: torch.Tensor | None = None, act: str = "gelu", round_norm: bool = False, norm_on_b: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_mm` that also writes the pre-activation: ``(pre, post)`` with ``pre = norm(a) @ b + bias``
    (as mm / addmm stores it) and ``post = residual + act(pre)``, one kernel, both (M, N) of ``b``'s
    dtype. For training graphs whose backward reads the pre-activation: it is written once, not
    written by the matmul and read back by a separate activation kernel."""
    if act == "none" and residual is None:
        raise KernelInputError("fused_mm_pre: with act='none' and no residual, pre and post are the same tensor; "
                               "call fused_mm instead")
    post, pre = _launch(a, b, True, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b)
    return pre, post


@torch.library.custom_op("mtc::fused_mm", mutates_args=())
def _fused_mm_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
    mean: torch.Tensor | None, rstd: torch.Tensor | None, norm_w: torch.Tensor | None, norm_b: torch.Tensor | None,
    act: str, round_norm: bool, norm_on_b: bool,
) -> torch.Tensor:
    return fused_mm(a, b, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b)


@_fused_mm_op.register_fake
def _(a, b, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b):
    return b.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("mtc::fused_mm_pre", mutates_args=())
def _fused_mm_pre_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
    mean: torch.Tensor | None, rstd: torch.Tensor | None, norm_w: torch.Tensor | None, norm_b: torch.Tensor | None,
    act: str, round_norm: bool, norm_on_b: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_mm_pre(a, b, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b)


@_fused_mm_pre_op.register_fake
def _(a, b, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b):
    return b.new_empty((a.shape[0], b.shape[1])), b.new_empty((a.shape[0], b.shape[1]))


def _act_ref(c: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu":
        return torch.nn.functional.gelu(c)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(c, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(c)
    if act == "relu":
        return torch.relu(c)
    return c


def fused_mm_pre_ref(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
    norm_b: torch.Tensor | None = None, act: str = "gelu", round_norm: bool = False, norm_on_b: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `fused_mm_pre`: the separate ATen ops, keeping the product."""
    if rstd is not None:
        x = (b if norm_on_b else a).float()
        if mean is not None:
            x = x - mean.reshape(-1, 1).float()
        x = x * rstd.reshape(-1, 1).float()
        if round_norm:
            x = x.to(b.dtype).float()
        if norm_w is not None:
            x = x * norm_w.float()
        if norm_b is not None:
            x = x + norm_b.float()
        if norm_on_b:
            b = x.to(b.dtype)
        else:
            a = x.to(b.dtype)
    pre = a @ b if bias is None else torch.addmm(bias, a, b)
    post = _act_ref(pre, act)
    return pre, post if residual is None else post + residual


def fused_mm_ref(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
    norm_b: torch.Tensor | None = None, act: str = "none", round_norm: bool = False, norm_on_b: bool = False,
) -> torch.Tensor:
    """Pure-torch reference of `fused_mm`: the separate ATen ops it replaces."""
    return fused_mm_pre_ref(a, b, bias, residual, mean, rstd, norm_w, norm_b, act, round_norm, norm_on_b)[1]
