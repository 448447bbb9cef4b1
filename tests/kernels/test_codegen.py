"""Generated kernels against ATen execution of the same fusion group, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from mtc.graphs.lower import forward_graph, joint_graph
from mtc.graphs.partition import partition
from mtc.kernels.codegen import FUSIBLE, CodegenError, compile_group
from torch import nn

from mtc.compiler import TEMPLATE_SWAPS
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
    dev = inputs[0].device if inputs else torch.device("cpu")
    for n in group.nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
        # a model traced on the meta device bakes device=meta into factory and copy ops
        kwargs = {k: dev if isinstance(v, torch.device) else v for k, v in kwargs.items()}
        env[n] = n.target(*args, **kwargs)
    return [env[o] for o in group.outputs]


def _groups(model: nn.Module, B: int, T: int):
    prog = trace(model, B, T)
    for t in prog.templates.values():
        for g in (forward_graph(t, TEMPLATE_SWAPS), joint_graph(t, TEMPLATE_SWAPS)[0]):
            yield from partition(g.graph, FUSIBLE).groups


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

    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(37, 3, 5), torch.randn(37)
    x = x.permute(1, 2, 0)  # (3, 5, 37) non-contiguous
    g = make_fx(lambda a, b: f(a.transpose(0, 1), b), decomposition_table=core_aten_decompositions())(x, w)
    p = partition(g.graph, FUSIBLE)
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
    for g in (forward_graph(block, TEMPLATE_SWAPS), joint_graph(block, TEMPLATE_SWAPS)[0]):
        for group in partition(g.graph, FUSIBLE).groups:
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


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1600, 4096])
def test_norm_backward_rowcol_kernel_compiles_and_matches_aten_on_gpu(n, tmp_path):
    # the rowcol kernel compiled for real (the interpreter runs its row loop as Python ints): an
    # RMSNorm backward at the benchmark's rows (8192) and GPT-2's / Llama's widths, bf16 inputs
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        xhat = xf * rstd
        gf = g.float()
        gw = (gf * xhat).sum([0, 1]).to(torch.bfloat16)
        gxhat = gf * w.float()
        return (rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))).to(torch.bfloat16), gw

    torch.manual_seed(0)
    g, x, w = (torch.randn(1, 8192, n, device="cuda").bfloat16(), torch.randn(1, 8192, n, device="cuda").bfloat16(),
               torch.randn(n, device="cuda").bfloat16())
    gr = make_fx(f, decomposition_table=core_aten_decompositions())(g, x, w)
    (group,) = partition(gr.graph, FUSIBLE).groups
    kern = compile_group(group, tmp_path)
    assert kern.mode == "rowcol"
    vals = _record(gr, g, x, w)
    for o, got in zip(group.outputs, kern(*[vals[i] for i in group.inputs]), strict=True):
        torch.testing.assert_close(got.float(), vals[o].float(), rtol=2e-2, atol=2e-2)


def _record(g: torch.fx.GraphModule, *args: torch.Tensor) -> dict:
    """Every node's value when ``g`` runs on ``args`` (what a group's kernel would be fed)."""
    vals = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            vals[n] = super().run_node(n)
            return vals[n]

    Rec(g).run(*args)
    return vals


def _check_groups(f, *args: torch.Tensor, tmp_path) -> list[str]:
    """Trace ``f`` to core ATen, compile every group and compare it with ATen on the same inputs;
    returns the kernel modes."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    g = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    p = partition(g.graph, FUSIBLE)
    assert not any(n.target is torch.ops.aten.cat.default for n in p.fallbacks), p.fallback_ops()
    vals = _record(g, *args)
    modes = []
    for group in p.groups:
        kern = compile_group(group, tmp_path)
        got = kern(*[vals[i] for i in group.inputs])
        for o, t in zip(group.outputs, got, strict=True):
            torch.testing.assert_close(t, vals[o], rtol=1e-5, atol=1e-5, msg=lambda m: f"{group.name} ({kern.mode}): {m}")
        modes.append(kern.mode)
    return modes


def test_rope_cat_is_one_pointwise_kernel(tmp_path):
    # x*cos + rotate_half(x)*sin with a ragged split (12 + 7 columns) of a transposed input
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        return x * cos + torch.cat((-x[..., 7:], x[..., :7]), dim=-1) * sin

    x, cos, sin = torch.randn(3, 5, 2, 19), torch.randn(5, 19), torch.randn(5, 19)
    assert _check_groups(rope, x, cos, sin, tmp_path=tmp_path) == ["pointwise"]


def test_cat_of_computed_parts_and_a_broadcast_column(tmp_path):
    # parts computed in the kernel (as in Llama's RoPE), one of them a single broadcast column
    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        y = torch.cat([a * 2.0 - b[..., :5], b.exp(), c.sigmoid()], dim=-1)
        return y * y + 1.0

    a, b, c = torch.randn(7, 5), torch.randn(7, 19), torch.randn(7, 1)
    assert _check_groups(f, a, b, c, tmp_path=tmp_path) == ["pointwise"]


def test_cat_inside_a_row_kernel(tmp_path):
    # an RMSNorm of a cat: the reduction runs over the whole cat row
    def f(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.cat([a.tanh(), b * 3.0], dim=-1)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    a, b, w = torch.randn(2, 7, 12), torch.randn(2, 7, 7), torch.randn(19)
    assert _check_groups(f, a, b, w, tmp_path=tmp_path) == ["row"]


@pytest.mark.parametrize("rows,n", [(7, 19), (5 * 29, 19), (3, 1031)])
def test_column_sum_with_fused_producer(rows, n, tmp_path):
    # the RMSNorm weight gradient sum(g * xhat, [0, 1]): ragged row tiles and column blocks
    def f(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (g * x.transpose(0, 1) * 0.5).sum([0, 1], keepdim=True)

    g, x = torch.randn(rows, 1, n), torch.randn(1, rows, n)
    assert _check_groups(f, g, x, tmp_path=tmp_path) == ["column"]


def test_column_reductions_without_keepdim_and_extra_outputs(tmp_path):
    # a bias gradient (M, N) -> (N,), a mean and an amax, all in one kernel that also stores h
    def f(g: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = g * b
        return h.sum(0), h.mean(0, keepdim=True), h.amax(0), torch.mm(h, b.reshape(19, 1))

    g, b = torch.randn(21, 19), torch.randn(19)
    assert _check_groups(f, g, b, tmp_path=tmp_path) == ["column"]


def test_sibling_column_sums_share_one_kernel(tmp_path):
    # a LayerNorm's weight and bias gradients, sum(dy * xhat) and sum(dy): not connected by any
    # node, but both read dy over one shape, so one kernel reads it once
    def f(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (g * x).sum([0, 1]), g.sum([0, 1])

    g, x = torch.randn(3, 5, 19), torch.randn(3, 5, 19)
    assert _check_groups(f, g, x, tmp_path=tmp_path) == ["column"]


def test_cat_that_cannot_be_fused_stays_on_aten():
    from mtc.graphs.partition import classify
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([a, a], dim=0) * 2.0, torch.cat([i, i], dim=-1)  # not the last dim; integers

    g = make_fx(f, decomposition_table=core_aten_decompositions())(torch.randn(3, 4), torch.ones(3, 2, dtype=torch.int64))
    cats = [n for n in g.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert [classify(n, FUSIBLE) for n in cats] == ["fallback", "fallback"]


def test_launch_plans_are_worked_out_once_per_input_signature(tmp_path, monkeypatch):
    # a graph calls each kernel with the same shapes and strides every time: the checks and
    # strides run once per signature, and a new layout or a wrong shape is still seen
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.errors import KernelInputError
    from mtc.kernels import codegen

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x, w = torch.randn(6, 37), torch.randn(37)
    g = make_fx(f, decomposition_table=core_aten_decompositions())(x, w)
    (group,) = partition(g.graph, FUSIBLE).groups
    kern = compile_group(group, tmp_path)
    planned = []
    real = codegen.FusedKernel._plan
    monkeypatch.setattr(codegen.FusedKernel, "_plan", lambda self, ins: planned.append(1) or real(self, ins))
    for _ in range(3):
        torch.testing.assert_close(kern(x, w)[0], f(x, w), rtol=1e-5, atol=1e-5)
    assert len(planned) == 1
    xt = torch.randn(37, 6).t()  # same shape, transposed strides: a plan of its own, and right
    torch.testing.assert_close(kern(xt, w)[0], f(xt, w), rtol=1e-5, atol=1e-5)
    assert len(planned) == 2
    with pytest.raises(KernelInputError, match="expected"):
        kern(torch.randn(5, 37), w)
    with pytest.raises(KernelInputError, match="expected tensors"):
        kern(x, 2.0)


def test_cast_of_a_column_sum_is_done_by_the_combine(tmp_path, monkeypatch):
    # a LayerNorm's weight and bias gradients, summed in fp32 and cast to the weight's dtype: the
    # casts join the column kernel (its second stage casts as it combines), no kernel of their own
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dw = (g.float() * x).sum([0, 1])
        db = g.float().sum([0, 1])
        return dw.to(torch.bfloat16), db.to(torch.bfloat16), (g.float() * 2).sum([0, 1])  # the last stays fp32

    g, x = torch.randn(3, 7, 19).to(torch.bfloat16), torch.randn(3, 7, 19)
    gr = make_fx(f, decomposition_table=core_aten_decompositions())(g, x)
    p = partition(gr.graph, FUSIBLE)
    (group,) = p.groups
    assert [o.meta["val"].dtype for o in group.outputs] == [torch.bfloat16, torch.bfloat16, torch.float32]
    kern = compile_group(group, tmp_path)
    assert kern.mode == "column" and kern.combine == ["sum", "sum", "sum"]
    vals = _record(gr, g, x)
    from mtc.kernels import codegen

    combines = []
    real = codegen.combine_partials
    monkeypatch.setattr(codegen, "combine_partials", lambda p, *a: combines.append(tuple(p.shape)) or real(p, *a))
    for o, got in zip(group.outputs, kern(*[vals[i] for i in group.inputs]), strict=True):
        assert got.dtype == vals[o].dtype
        torch.testing.assert_close(got.float(), vals[o].float(), rtol=8e-3, atol=1e-5)  # bf16: one rounding
    # one second-stage launch per output dtype: the two bf16 gradients together, the fp32 sum apart
    assert [c[0] for c in combines] == [2, 1]


def test_an_op_reading_a_cast_column_sum_stays_out_of_the_column_kernel(tmp_path):
    # the cast folds into the combine, but what reads its result needs it complete: another kernel
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.graphs.partition import column_cast
    from mtc.kernels import codegen

    def f(g: torch.Tensor) -> torch.Tensor:
        return g.float().sum([0, 1]).to(torch.bfloat16) * 3.0

    g = torch.randn(3, 7, 19).to(torch.bfloat16)
    gr = make_fx(f, decomposition_table=core_aten_decompositions())(g)
    groups = partition(gr.graph, FUSIBLE).groups
    kerns = [compile_group(gp, tmp_path) for gp in groups]
    assert sorted(k.mode for k in kerns) == ["column", "pointwise"]
    col = groups[[k.mode for k in kerns].index("column")]
    (out,) = col.outputs
    assert column_cast(out, codegen.REDUCTIONS) is not None and out.meta["val"].dtype == torch.bfloat16
    assert not any(n.target is torch.ops.aten.mul.Tensor for n in col.nodes)
    vals = _record(gr, g)
    for gp, k in zip(groups, kerns, strict=True):
        for o, got in zip(gp.outputs, k(*[vals[i] for i in gp.inputs]), strict=True):
            torch.testing.assert_close(got.float(), vals[o].float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 19), (7, 19), (5 * 29, 37), (3, 1031)])
def test_norm_backward_is_one_row_and_column_kernel(rows, n, tmp_path):
    # an RMSNorm's backward: the input gradient needs a sum over each row, the weight gradient a
    # sum over every row of values computed from the same row; one kernel reads the row once
    # (ragged chunks of rows: 1 row, rows not a multiple of the chunk, a row wider than 1024)
    def f(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        xhat = x * rstd
        gw = (g * xhat).sum([0, 1])
        gxhat = g * w
        dx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return dx, gw

    g, x, w = torch.randn(1, rows, n), torch.randn(1, rows, n), torch.randn(n)
    assert _check_groups(f, g, x, w, tmp_path=tmp_path) == ["rowcol"]


def test_row_and_column_kernel_combines_means_maxes_and_casts(tmp_path, monkeypatch):
    # column mean, amax and a bf16-cast sum beside per-row outputs (a row sum and a full row):
    # the second stage combines the chunks of each kind, and casts
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.kernels import codegen

    def f(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x.float() * b
        s = h.sum(-1, keepdim=True)
        y = h - s
        return s, y, y.mean([0, 1]), y.amax([0, 1]), (y * h).sum([0, 1]).to(torch.bfloat16)

    x, b = torch.randn(2, 9, 23).to(torch.bfloat16), torch.randn(23)
    gr = make_fx(f, decomposition_table=core_aten_decompositions())(x, b)
    (group,) = partition(gr.graph, FUSIBLE).groups
    kern = compile_group(group, tmp_path)
    assert kern.mode == "rowcol" and kern.combine == [None, None, "mean", "amax", "sum"]
    combines = []
    real = codegen.combine_partials
    monkeypatch.setattr(codegen, "combine_partials", lambda p, *a: combines.append(a[0]) or real(p, *a))
    vals = _record(gr, x, b)
    for o, got in zip(group.outputs, kern(*[vals[i] for i in group.inputs]), strict=True):
        assert got.shape == vals[o].shape and got.dtype == vals[o].dtype
        torch.testing.assert_close(got.float(), vals[o].float(), rtol=8e-3, atol=1e-5)
    assert sorted(combines) == ["amax", "mean", "sum"]


def test_rows_wider_than_a_row_kernel_keep_row_and_column_kernels_apart():
    # a row of more than MAX_ROW columns cannot be held whole: the row reduction and the column
    # reduction stay in groups of their own, as before
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.graphs.partition import is_row_and_column
    from mtc.kernels.codegen import MAX_ROW

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * x.sum(-1, keepdim=True)
        return y, y.sum(0)

    for n, kinds in ((MAX_ROW, [True]), (MAX_ROW + 1, [False, False])):
        gr = make_fx(f, decomposition_table=core_aten_decompositions())(torch.empty(2, n, device="meta"))
        groups = partition(gr.graph, FUSIBLE).groups
        assert [is_row_and_column(g.nodes, FUSIBLE.reductions) for g in groups] == kinds


def _norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = x * rstd
    gxhat = g * w
    return rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True)), (g * xhat).sum([0, 1])


def _bias_grad(g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = g * torch.sigmoid(h)
    return d, d.sum([0, 1])


@pytest.mark.parametrize("f,mode", [(_norm_backward, "rowcol"), (_bias_grad, "column")])
def test_every_launch_configuration_computes_the_same_and_tuning_keeps_the_fastest(f, mode, tmp_path, monkeypatch):
    # column and rowcol kernels time their launch configurations on CUDA when a plan compiles: each
    # candidate (the GPU's and the interpreter's) must give the kernel's results, and the choice
    # must be what later launches use, what a compiled plan records and what seeding brings back
    from mtc.kernels import codegen
    from mtc.kernels.tuning import Decisions, Tuner
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.randn(1, 150, 37), torch.randn(1, 150, 37)) + ((torch.randn(37),) if mode == "rowcol" else ())
    gr = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    (group,) = partition(gr.graph, FUSIBLE).groups
    kern = compile_group(group, tmp_path)
    assert kern.mode == mode
    vals = _record(gr, *args)
    ins = [vals[i] for i in group.inputs]
    gpu, cpu = kern.candidates(cuda=True), kern.candidates(cuda=False)
    assert len(gpu) >= 3 and len(cpu) >= 2 and gpu[0] != cpu[0]
    for cfg in gpu + cpu:
        plan = kern._plan(tuple(ins), cfg)
        for o, got in zip(group.outputs, kern._columns(ins, plan), strict=True):
            torch.testing.assert_close(got, vals[o], rtol=1e-5, atol=1e-5, msg=lambda m, c=cfg: f"{c}: {m}")
    # tuning: a substituted clock makes the last CPU candidate the fastest
    clock = [float(t) for t in range(len(cpu), 0, -1)]
    monkeypatch.setattr(codegen, "_TUNER", Tuner("test", bench=lambda fn: (fn(), clock.pop(0))[1]))
    with codegen.generated_tuning() as rec:
        assert kern.tune(ins) is None  # the CPU times nothing unless forced
        choice = kern.tune(ins, force=True)
        assert choice == cpu[-1] and not clock
        kern(*ins)
    (plan,) = kern._plans.values()
    assert plan == kern._plan(tuple(ins), cpu[-1]) != kern._plan(tuple(ins), cpu[0])
    assert list(rec.choices.values()) == [cpu[-1]] and next(iter(rec.choices)).startswith(kern.__name__ + "/1x150x37/")
    # a later process: the plan's record seeds the tuner, and the kernel launches with the choice untimed
    monkeypatch.setattr(codegen, "_TUNER", Tuner("test", bench=lambda fn: pytest.fail("timed again")))
    codegen.seed_generated_tuning(Decisions.from_json(rec.to_json()))
    fresh = compile_group(group, tmp_path)
    fresh(*ins)
    assert list(fresh._plans.values()) == [plan]


@pytest.mark.parametrize("kind", ["pointwise", "row"])
def test_an_output_recorded_in_a_transposed_layout_is_written_in_it(kind, tmp_path):
    # ATen lays a pointwise result out like its input (here (B, T, H, D) seen as (B, H, T, D)), and
    # the graph's views of it were traced against that layout: the kernel writes it so
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.kernels.codegen import load_kernel

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.transpose(1, 2)
        if kind == "row":
            return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * 2.0 + 1.0

    x = torch.randn(2, 5, 3, 8)
    g = make_fx(f, decomposition_table=core_aten_decompositions())(x)
    vals = _record(g, x)
    (group,) = partition(g.graph, FUSIBLE).groups
    (out,) = group.outputs
    assert not vals[out].is_contiguous()
    kern = compile_group(group, tmp_path)
    assert kern.mode == kind
    for k in (kern, load_kernel(kern.spec(), tmp_path)):  # a loaded plan's kernel writes it alike
        (got,) = k(*[vals[i] for i in group.inputs])
        assert got.stride() == vals[out].stride()
        torch.testing.assert_close(got, vals[out], rtol=1e-5, atol=1e-6)


B_, T_, H_, D_ = 2, 5, 3, 8


def _col(x):  # a column kernel's full-shape output, recorded transposed, viewed later
    y = x.transpose(1, 2) * 2.0
    return y.transpose(1, 2).view(B_, T_, H_ * D_), y.sum(dim=(0, 1, 2))


def _per_row(x, s):  # a row kernel's per-row output (B, H, T, 1), recorded in the (B, T, H, 1) layout
    r = s.transpose(1, 2) * 2.0
    z = x.transpose(1, 2) * x.transpose(1, 2).sum(-1, keepdim=True)
    return z, (r * z.mean(-1, keepdim=True)).transpose(1, 2).view(B_, T_ * H_)


def _last_one(s):  # a last dim of size 1: its stride is irrelevant
    return ((s.transpose(1, 2) * 2.0).transpose(1, 2).view(B_, T_ * H_),)


def _last_dim_moved(x):  # the last dim not innermost: written strided, as recorded
    return ((x.transpose(-1, -2) * 2.0).transpose(-1, -2).view(B_, T_, H_ * D_),)


@pytest.mark.parametrize("f, shapes, kernels", [
    (_col, [(B_, T_, H_, D_)], ["column"]),
    (_per_row, [(B_, T_, H_, D_), (B_, T_, H_, 1)], ["row"]),
    (_last_one, [(B_, T_, H_, 1)], ["pointwise"]),
    (_last_dim_moved, [(B_, T_, H_, D_)], ["pointwise"]),
])
def test_the_graph_views_values_in_the_layouts_it_recorded_for_them(f, shapes, kernels, tmp_path):
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.compiler import _fuse

    args = [torch.randn(s) for s in shapes]
    g = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    fused, _ = _fuse(g.graph, tmp_path)
    assert [n.target.mode for n in fused.nodes if hasattr(n.target, "mode")] == kernels
    for got, want in zip(torch.fx.GraphModule(g, fused)(*args), f(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("e", [3.0, 5, -1, -2.0, -3, 0])
def test_integral_powers_of_negative_bases(e, tmp_path):
    # pow(x, e) of a negative x is real for an integral exponent (x ** 3.0, 1 / x ** 2); computing
    # it as exp(e * log(x)) gave NaN there, and pow(x, 0) must be 1 even at x = 0
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.pow(e) * 0.5

    x = torch.randn(3, 7)
    x[0, 0] = -2.0
    if e == 0:
        x[0, 1] = 0.0
    assert _check_groups(f, x, tmp_path=tmp_path) == ["pointwise"]


def test_float64_and_integer_arithmetic_stays_exact(tmp_path):
    # a generated kernel computes in fp32: float64 math a model does on purpose (rotary angles at
    # long context, a sum that cancels) and int64 sums past 2^24 lost their low bits there, and the
    # compiled layer silently differed from torch; they stay on ATen, and the fp32 ops around them fuse
    def f(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.double()
        return ((h + 1e8) - 1e8).float() * 2.0, (i * 3).sum(-1, keepdim=True)

    x, i = torch.randn(3, 7), torch.randint(0, 5, (3, 7))
    i[:, 0], i[:, 1] = (1 << 30) + 1, -(1 << 30)  # their sum, 1, is lost in fp32
    assert _check_groups(f, x, i, tmp_path=tmp_path) == ["pointwise"]


def test_integer_comparisons_stay_exact(tmp_path):
    # a comparison computes in its inputs' dtype: int64 positions or ids past 2^24 compared in a
    # kernel's fp32 were equal where torch's were not; the comparison stays on ATen
    def f(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x * (i == 16777217) + x.sigmoid()

    x, i = torch.randn(3, 7), torch.full((3, 7), 16777216)
    assert _check_groups(f, x, i, tmp_path=tmp_path) == ["pointwise"]
