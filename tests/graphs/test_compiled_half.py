"""Compiled templates in half precision: as close to an fp32 run as eager half precision is.

Each architecture's block and head are compiled (generated kernels, flash attention, fused linear +
cross-entropy) and run forward + backward in half precision; so is the unfused ATen template.
Both are compared with the same template traced and run in fp32: the compiled error must stay
within twice the eager error (plus a small floor), for the output and every gradient.

On the GPU: bf16 at real shapes (`gpu` marker). On the CPU: fp16 at tiny shapes (the Triton
interpreter computes fp16 right and bf16 wrong), which also keeps this harness itself tested.
"""

from __future__ import annotations

import pytest
import torch

from mtc.compiler import compile_template
from mtc.models import build, model_config
from mtc.tracer import trace

REAL = {
    "llama": ("8b", {"n_layers": 1}),
    "qwen2": ("qwen2-tiny", {"n_layers": 1, "vocab_size": 32000, "dim": 3584, "n_heads": 28, "n_kv_heads": 4,
                             "ffn_dim": 18944, "max_seq_len": 2048}),
    "gpt2": ("gpt2-tiny", {"n_layers": 1, "vocab_size": 50257, "dim": 1600, "n_heads": 25, "max_seq_len": 2048}),
}
TINY = {
    "llama": ("tiny", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}),
    "qwen2": ("qwen2-tiny", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}),
    "gpt2": ("gpt2-tiny", {"n_layers": 1, "dim": 64, "n_heads": 4}),
}


def _template(name, over, dtype, tokens, part):
    with torch.device("meta"):
        model = build(name, **over).to(dtype)
    prog = trace(model, 1, tokens)
    call = prog.layers[1] if part == "block" else prog.layers[-1]
    return prog.templates[call.template], call


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def compare_half_with_fp32(name, over, part, dtype, tokens, device, tmp_path) -> list[tuple[float, float]]:
    """(compiled error, eager error) vs fp32 for the output and each gradient; asserts the bound."""
    t16, call = _template(name, over, dtype, tokens, part)
    t32, _ = _template(name, over, torch.float32, tokens, part)
    vocab = model_config(name, **over).vocab_size
    gen = torch.Generator(device).manual_seed(0)
    args = []
    for inp in t32.inputs:
        kind, shape = call.bindings[inp.name].kind, inp.spec.shape
        if kind == "batch":
            args.append(torch.randint(0, vocab, shape, device=device, generator=gen))
        else:
            scale = 0.02 if kind == "param" and len(shape) == 2 else 1.0
            args.append(torch.randn(shape, device=device, generator=gen) * scale)
    diff = [k for k, i in enumerate(t32.inputs) if i.kind in ("carry", "param")]
    gout = torch.randn(t32.inputs[0].spec.shape if part == "block" else (), device=device, generator=gen)

    def eager(t, xs, g):
        xs = [x.detach().requires_grad_(k in diff) for k, x in enumerate(xs)]
        out = t.module(device)(*xs)[0]
        return [out.detach(), *torch.autograd.grad(out, [xs[k] for k in diff], g.to(out.dtype))]

    half = [a.to(dtype) if a.is_floating_point() else a for a in args]
    want = eager(t32, args, gout)
    ref = eager(t16, half, gout)
    ct = compile_template(t16, tmp_path, joint_outputs=True)  # the output checked too
    with torch.no_grad():
        got = list(ct.module("joint", device)(*half, gout.to(ref[0].dtype)))
    errs = []
    for j, (a, r, w) in enumerate(zip(got, ref, want, strict=True)):
        assert a.dtype == r.dtype and a.shape == r.shape, j
        fused, plain = _rel(a, w), _rel(r, w)
        assert fused <= 2 * plain + 2e-3, f"{name}/{part} output {j}: compiled {fused:.2e} vs eager {plain:.2e} (relative to fp32)"
        errs.append((fused, plain))
    return errs


@pytest.mark.parametrize("part", ["block", "head"])
@pytest.mark.parametrize("arch", list(TINY))
def test_fp16_tiny_on_cpu(arch, part, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the bf16 real-shape version")
    errs = compare_half_with_fp32(*TINY[arch], part, torch.float16, 16, "cpu", tmp_path)
    assert max(e for e, _ in errs) > 0  # half precision really ran


@pytest.mark.gpu
@pytest.mark.parametrize("part", ["block", "head"])
@pytest.mark.parametrize("arch", list(REAL))
def test_bf16_real_shapes_on_gpu(arch, part, tmp_path):
    compare_half_with_fp32(*REAL[arch], part, torch.bfloat16, 2048, "cuda", tmp_path)
