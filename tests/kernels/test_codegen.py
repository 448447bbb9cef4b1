"""Generated kernels against ATen execution of the same fusion group, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mtc.graphs.partition import forward_graph, joint_graph, partition
from mtc.kernels.codegen import CodegenError, compile_group
from mtc.models.llama import Llama, preset
from mtc.tracer import trace


def _random_like(node) -> torch.Tensor:
    v = node.meta["val"]
    if v.dtype == torch.bool:
        return torch.rand(v.shape) > 0.5
    if not v.dtype.is_floating_point:
        return torch.randint(0, 5, v.shape, dtype=v.dtype)
    return torch.randn(v.shape, dtype=v.dtype).abs() + 0.1  # positive: rsqrt/log/pow stay finite


def _run_aten(group, inputs):
    env = dict(zip(group.inputs, inputs, strict=True))
    for n in group.nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
        env[n] = n.target(*args, **kwargs)
    return [env[o] for o in group.outputs]


def _groups(model: nn.Module, B: int, T: int):
    prog = trace(model, B, T)
    for t in prog.templates.values():
        for g in (forward_graph(t), joint_graph(t)[0]):
            yield from partition(g.graph).groups


@pytest.fixture(scope="module")
def llama_groups():
    torch.manual_seed(0)
    return list(_groups(Llama(preset("tiny", n_layers=1, dim=48, n_heads=2, n_kv_heads=1, ffn_dim=40)), 2, 5))


def test_every_llama_group_matches_aten(llama_groups, tmp_path):
    generated = skipped = 0
    for group in llama_groups:
        try:
            kern = compile_group(group, tmp_path)
        except CodegenError:
            skipped += 1
            continue
        inputs = [_random_like(i) for i in group.inputs]
        want = _run_aten(group, inputs)
        got = kern(*inputs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{group.name} ({kern.mode}): {m}")
        generated += 1
    assert generated >= 0.8 * (generated + skipped), (generated, skipped)
    assert any(compile_group(g, tmp_path).mode == "row" for g in llama_groups if g.reduces)


def test_row_kernel_handles_ragged_rows_and_strided_inputs(tmp_path):
    # an RMSNorm on a transposed input with a row length that is not a power of two
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._decomp import core_aten_decompositions

    x, w = torch.randn(37, 3, 5), torch.randn(37)
    x = x.permute(1, 2, 0)  # (3, 5, 37) non-contiguous
    g = make_fx(lambda a, b: f(a.transpose(0, 1), b), decomposition_table=core_aten_decompositions())(x, w)
    p = partition(g.graph)
    (group,) = [gr for gr in p.groups if gr.reduces]
    kern = compile_group(group, tmp_path)
    env = {n.name: None for n in g.graph.nodes}
    del env
    # feed the group the same tensors the graph would: evaluate the graph up to the group inputs
    interp = torch.fx.Interpreter(g)
    vals = {}

    def run_node(n):
        r = torch.fx.Interpreter.run_node(interp, n)
        vals[n] = r
        return r

    interp.run_node = run_node
    interp.run(x, w)
    got = kern(*[vals[i] for i in group.inputs])
    for o, t in zip(group.outputs, got, strict=True):
        torch.testing.assert_close(t, vals[o], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_real_shape_llama_groups_bf16_on_gpu(tmp_path):
    # every generated group of an 8B-shaped block (bf16, 2048 tokens) against ATen on the GPU
    with torch.device("meta"):
        model = Llama(preset("8b", n_layers=1)).to(torch.bfloat16)
    prog = trace(model, 1, 2048)
    block = prog.templates[prog.layers[1].template]
    checked = 0
    for g in (forward_graph(block), joint_graph(block)[0]):
        for group in partition(g.graph).groups:
            try:
                kern = compile_group(group, tmp_path)
            except CodegenError:
                continue
            inputs = [_random_like(i).cuda() for i in group.inputs]
            want = _run_aten(group, inputs)
            got = kern(*inputs)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            checked += 1
    assert checked > 20
