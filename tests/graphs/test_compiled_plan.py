"""Plans load, not recompile: `compile_program` stores each compiled template (graphs with kernels
spliced in, the report, its key) and loads it back; a stale key recompiles exactly that template,
with one line saying why. Also the CPU-countable proxy for kernel launches."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from mtc import compiler
from mtc.compiler import compile_program, launches
from mtc.kernels.tuning import tuning_input
from mtc.models import build
from mtc.tracer import trace

# Kernel-invoking nodes per compiled graph of the 2-layer presets at micro-batch 2 x 8, as counted
# on the CPU (where matmul_fusion "auto" fuses nothing): (forward, joint) per template and, for a
# block, also its split graphs (save, backward). Exact: a pass that stops fusing something raises a
# count and fails here; one that fuses more lowers it, and then this table is updated to match.
LAUNCHES = {
    "tiny": {"embed": (6, 1), "block": (14, 31, 14, 22), "head": (2, 3)},
    "gpt2-tiny": {"embed": (4, 4), "block": (9, 20, 9, 14), "head": (2, 3)},
}
# On CUDA "auto" times each matmul-fusion site (kernels/matmul_fusion.py) and fuses those that beat
# cuBLAS, so which sites fuse depends on the GPU: there a count lies between the one above and the
# one with every site fused (matmul_fusion="on", which asks no timing; counted on the CPU).
LAUNCHES_ALL_FUSED = {
    "tiny": {"embed": (6, 1), "block": (13, 31, 13, 22), "head": (2, 3)},
    "gpt2-tiny": {"embed": (4, 4), "block": (7, 20, 8, 14), "head": (2, 3)},
}


@pytest.fixture
def counted(monkeypatch):
    calls: list[str] = []
    real = compiler.compile_template

    def counting(t, *a, **k):
        calls.append(t.id)
        return real(t, *a, **k)

    monkeypatch.setattr(compiler, "compile_template", counting)
    return calls


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """The 2-layer tiny preset compiled once into a kernel cache (the plan test changes it last)."""
    torch.manual_seed(0)
    prog = trace(build("tiny", n_layers=2), 2, 8)
    cache = tmp_path_factory.mktemp("tiny-plan")
    return prog, cache, compile_program(prog, cache, log=None)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_launches_per_compiled_graph(name, tmp_path, tiny_plan):
    if name == "tiny":
        prog, _, compiled = tiny_plan
    else:
        torch.manual_seed(0)
        prog = trace(build(name, n_layers=2), 2, 8)
        compiled = compile_program(prog, tmp_path, log=None)
    assert sorted({t.kind for t in prog.templates.values()}) == sorted(LAUNCHES[name])
    for tid, ct in compiled.items():
        kind = prog.templates[tid].kind
        graphs = [ct.forward_graph, ct.joint_graph] + ([ct.save_graph, ct.backward_graph] if kind == "block" else [])
        got = tuple(launches(g) for g in graphs)
        if torch.cuda.is_available():
            assert all(lo <= n <= hi for lo, n, hi in zip(LAUNCHES_ALL_FUSED[name][kind], got, LAUNCHES[name][kind], strict=True)), (kind, got)
        else:
            assert got == LAUNCHES[name][kind], (kind, got)
        # the report's count of launches after fusion is what the graph calls
        assert got[:2] == (ct.forward_report.kernels, ct.backward_report.kernels)
        if kind == "block":
            assert got[2:] == (ct.split_reports["save"].kernels, ct.split_reports["backward_saved"].kernels)


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_attention_output_reaches_the_output_projection_without_a_copy(name, tmp_path, monkeypatch):
    # "attention layouts": RoPE's q and k (Llama) or the split projection's q (GPT-2) reach attention
    # as views of (B, T, H, D) buffers, its output follows q's layout, and the transpose back to
    # (B, T, H * D) is a view: one kernel fewer in the forward and in the joint graph
    torch.manual_seed(0)
    prog = trace(build(name, n_layers=1), 2, 8)
    t = next(tt for tt in prog.templates.values() if tt.kind == "block")
    ct = compiler.compile_template(t, tmp_path / "with")
    monkeypatch.setattr(compiler, "PASSES", [p for p in compiler.PASSES if p.name != "attention layouts"])
    without = compiler.compile_template(t, tmp_path / "without")
    for which in ("forward_graph", "joint_graph"):
        g = getattr(ct, which)
        assert launches(g) == launches(getattr(without, which)) - 1, which
        fwd = next(n for n in g.nodes if str(n.target) == "mtc.flash_attention_fwd.default")
        assert fwd.meta["val"][0].transpose(1, 2).is_contiguous(), which
        assert aten_clone not in {n.target for n in g.nodes}, which


aten_clone = torch.ops.aten.clone.default


def test_replayed_graphs_launch_a_few_kernels_per_call(tiny_plan):
    # CUDA-graph replay (mtc.runtime.graph_replay): copies in + one graph launch + clones out
    from mtc.runtime.graph_replay import capture_blocker, launches_per_replay

    prog, _, compiled = tiny_plan
    for tid, ct in compiled.items():
        t = prog.templates[tid]
        for which, g in (("forward", ct.forward_graph), ("joint", ct.joint_graph)):
            assert capture_blocker(g) is None, (tid, which)
            per_call = launches_per_replay(g, t, which, ct.diff, 1 + t.n_aux_out)
            assert per_call <= 8, (tid, which, per_call)
            if t.kind == "block":  # eager: one launch per kernel-invoking node
                assert 2 * per_call < launches(g), (which, per_call, launches(g))


def test_attention_choices_are_part_of_the_plan(tiny_plan, counted, tmp_path, monkeypatch):
    """Compiling a template times its attention kernels once and stores the choices in its record;
    a process that loads the plan gets them back without timing anything; a changed kernel-source
    hash makes the record stale: that template is recompiled and timed again, saying why."""
    from mtc.kernels import flash_attention as fa
    from mtc.kernels.tuning import Tuner

    prog, shared, _ = tiny_plan
    cache = tmp_path / "plan"
    shutil.copytree(shared, cache)
    block = next(c.template for c in prog.iter_blocks())
    # two tile candidates per kernel in the interpreter (it has one: nothing to time), the second
    # one "faster" on a clock that launches each candidate
    monkeypatch.setitem(fa._TILES, "interpreter",
                        {"fwd": [(16, 16, 1, 1), (32, 16, 1, 1)], "dq": [(16, 16, 1, 1), (32, 16, 1, 1)],
                         "dkdv": [(16, 16, 1, 1), (16, 32, 1, 1)]})
    timed: list[object] = []

    def clock(fn):
        timed.append(fn)
        fn()
        return 2.0 if len(timed) % 2 else 1.0

    monkeypatch.setattr(fa, "_TUNER", Tuner("flash_attention", bench=clock))
    rec = cache / compiler.RECORDS / f"{block}.json"
    doc = json.loads(rec.read_text())
    doc["key"]["kernel sources"] = "0" * 16
    rec.write_text(json.dumps(doc))
    msgs: list[str] = []
    compiled = compile_program(prog, cache, log=msgs.append)
    assert counted == [block] and msgs == [f"recompiling template {block}: stale (kernel sources changed)"]
    assert len(timed) == 6  # fwd, dq, dkdv: two candidates each, once for the template's one attention shape
    choices = json.loads(rec.read_text())["tuning"]["attention"]["choices"]
    want = {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32)}
    assert {k.split("/")[0]: (v["BLOCK_M"], v["BLOCK_N"]) for k, v in choices.items() if isinstance(v, dict)} == want
    assert [v for k, v in choices.items() if k.startswith("bwd_backend/")] == ["triton"]
    ct = compiled[block]
    assert not ct.loaded and ct.seconds > ct.tuning_s > 0
    times = compiler.plan_times(compiled)
    assert (times.compiled, times.loaded) == (1, len(prog.templates) - 1) and times.tuning_s == ct.tuning_s
    report = compiler.write_report(prog, compiled, tmp_path)
    assert report.splitlines()[-1] == compiler.format_plan_times(times)
    assert json.loads((tmp_path / "compile_report.json").read_text())["plan"]["compiled"] == 1
    # a new process: a fresh tuner whose clock must not be called; loading the plan seeds it
    never: list[object] = []
    monkeypatch.setattr(fa, "_TUNER", Tuner("flash_attention", bench=lambda fn: never.append(fn) or 1.0))
    loaded = compile_program(prog, cache, log=msgs.append)
    assert counted == [block] and len(msgs) == 1 and all(c.loaded and c.tuning_s == 0 for c in loaded.values())
    t = prog.templates[block]
    loaded[block].module("joint", "cpu")(*(torch.randn(i.spec.shape) for i in t.inputs), torch.randn(prog.carry.shape))
    assert never == [] and fa.tuning_seconds() == 0
    assert {k[0]: (v["BLOCK_M"], v["BLOCK_N"]) for k, v in fa._TUNER.best.items() if isinstance(v, dict)} == want


def _other_spec(t, kind, field):
    """``t``'s inputs with the first one's shape (field "shapes") or dtype ("dtypes") changed, for a
    template of ``kind``; the others' unchanged."""
    if t.kind != kind:
        return t.inputs
    i = t.inputs[0]
    spec = i.spec
    spec = dataclasses.replace(spec, shape=(*spec.shape[:-1], spec.shape[-1] + 1)) if field == "shapes" else \
        dataclasses.replace(spec, dtype="bfloat16" if spec.dtype != "bfloat16" else "float32")
    return [dataclasses.replace(i, spec=spec), *t.inputs[1:]]


def _key_text(t, field):
    return " ".join("x".join(map(str, i.spec.shape)) or "scalar" if field == "shapes" else i.spec.dtype for i in t.inputs)


# what a compiled template is keyed by (the list); each case changes what the key reads for
# that one field: (field, the kind of template it changes: None for all)
KEY_FIELDS = [("mtc", None), ("kernel sources", None), ("torch", None), ("triton", None), ("device", None),
              ("shapes", "block"), ("shapes", "head"), ("dtypes", "embed"), ("dtypes", "block")]


@pytest.mark.parametrize(("field", "kind"), KEY_FIELDS, ids=[f"{f}-{k or 'all'}" for f, k in KEY_FIELDS])
def test_each_key_field_makes_a_stored_plan_stale(field, kind, tiny_plan, tmp_path, monkeypatch):
    """A plan compiled before loads while its key is unchanged; changing just one field the key is
    made of (mtc version, kernel-source hash, torch, triton, device capability, an input's shape or
    dtype) reports exactly the templates it concerns as stale, naming the field and its values, and
    the rewritten records load again. Compiling is stubbed out: the stub hands back the template the
    fixture compiled and puts its kernels where the current toolchain looks for them."""
    import triton

    prog, shared, first = tiny_plan
    cache = tmp_path / "plan"
    shutil.copytree(shared, cache)
    kernels = shared / compiler.cache_key()
    assert kernels.is_dir()
    calls: list[str] = []

    def compiled_before(t, cache_dir, **kw):
        calls.append(t.id)
        shutil.copytree(kernels, Path(cache_dir) / compiler.cache_key(), dirs_exist_ok=True)
        return copy.copy(first[t.id])

    monkeypatch.setattr(compiler, "compile_template", compiled_before)
    msgs: list[str] = []
    compile_program(prog, cache, log=msgs.append)  # the shared plan as the fixture's options left it
    calls.clear()
    msgs.clear()
    again = compile_program(prog, cache, log=msgs.append)  # unchanged key: everything loads
    assert calls == [] and msgs == [] and all(ct.loaded for ct in again.values())

    old = {"mtc": compiler._mtc_version(), "kernel sources": compiler._source_hash(), "torch": torch.__version__,
           "triton": triton.__version__, "device": compiler._capability()}
    new = {"mtc": "99.0.0", "kernel sources": "f" * 16, "torch": TorchVersion("99.0.0"), "triton": "99.0.0",
           "device": "sm99"}
    if field in ("shapes", "dtypes"):
        stale = [tid for tid, t in prog.templates.items() if t.kind == kind]
        assert len(stale) == 1
        t = prog.templates[stale[0]]
        before = _key_text(t, field)
        monkeypatch.setattr(t, "inputs", _other_spec(t, kind, field))
        why = {stale[0]: f"{field} {before} -> {_key_text(t, field)}"}
    else:
        stale = list(prog.templates)
        why = dict.fromkeys(stale, "kernel sources changed" if field == "kernel sources" else f"{field} {old[field]} -> {new[field]}")
        if field == "torch":
            monkeypatch.setattr(torch, "__version__", new[field])
        elif field == "triton":
            monkeypatch.setattr(triton, "__version__", new[field])
        else:
            fn = {"mtc": "_mtc_version", "kernel sources": "_source_hash", "device": "_capability"}[field]
            monkeypatch.setattr(compiler, fn, lambda v=new[field]: v)
    compiled = compile_program(prog, cache, log=msgs.append)
    assert calls == stale
    assert msgs == [f"recompiling template {tid}: stale ({why[tid]})" for tid in stale]
    assert [tid for tid, ct in compiled.items() if not ct.loaded] == stale
    # rewritten under the new key: loads again, nothing recompiled
    calls.clear()
    msgs.clear()
    compiled = compile_program(prog, cache, log=msgs.append)
    assert calls == [] and msgs == [] and all(ct.loaded for ct in compiled.values())


def test_plan_loads_without_recompiling_and_stale_key_recompiles_one(tiny_plan, counted):
    prog, tmp_path, first = tiny_plan
    msgs: list[str] = []
    again = compile_program(prog, tmp_path, log=msgs.append)
    assert counted == [] and msgs == []
    assert all(ct.loaded for ct in again.values()) and not any(ct.loaded for ct in first.values())
    block = next(c.template for c in prog.iter_blocks())
    for tid, ct in again.items():
        assert ct.diff == first[tid].diff and ct.forward_report == first[tid].forward_report
        def names(g):
            return [getattr(n.target, "__name__", str(n.target)) for n in g.nodes]

        assert names(ct.joint_graph) == names(first[tid].joint_graph) and names(ct.forward_graph) == names(first[tid].forward_graph)
    # the loaded block computes what the freshly compiled one does (kernels re-imported from the cache)
    t = prog.templates[block]
    args = [torch.randn(i.spec.shape) for i in t.inputs]
    gout = torch.randn(prog.carry.shape)
    for a, b in zip(again[block].module("joint", "cpu")(*args, gout), first[block].module("joint", "cpu")(*args, gout), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and so do its split graphs (the forward that saves, the backward from saved values); the
    # embed stage and the head have none
    assert again[block].saved == first[block].saved and again[block].split_reports == first[block].split_reports
    assert all(ct.save_graph is None and ct.backward_graph is None for tid, ct in again.items() if tid != block)
    kept = [o[1:] for o in (again[block].module("save", "cpu")(*args), first[block].module("save", "cpu")(*args))]
    for a, b in zip(*kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(again[block].module("backward", "cpu")(*args, *kept[0], gout),
                    first[block].module("backward", "cpu")(*args, *kept[1], gout), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a stale key: exactly that template is recompiled, with one line naming it and why
    rec = tmp_path / compiler.RECORDS / f"{block}.json"
    doc = json.loads(rec.read_text())
    doc["key"]["torch"] = "0.0.1"
    rec.write_text(json.dumps(doc))
    compile_program(prog, tmp_path, log=msgs.append)
    assert counted == [block]
    assert msgs == [f"recompiling template {block}: stale (torch 0.0.1 -> {torch.__version__})"]
    counted.clear()
    compile_program(prog, tmp_path, log=msgs.append)  # rewritten with the current key: fresh again
    assert counted == [] and len(msgs) == 1
    # the matmul-fusion mode is part of the key: another mode recompiles every template, saying so
    compile_program(prog, tmp_path, log=msgs.append, matmul_fusion="off")
    assert sorted(counted) == sorted(prog.templates)
    assert all("matmul_fusion=auto" in m and m.endswith("matmul_fusion=off)") for m in msgs[1:]) and len(msgs) == 1 + len(prog.templates)


def test_the_compilers_docstring_lists_every_pass_in_order():
    # the pipeline is read off mtc/compiler.py's docstring: it must be PASSES, in order
    # (a name may wrap: "copy broadcast outputs" is listed as "copy broadcast" and "  outputs")
    doc = compiler.__doc__
    at = [doc.find("\n    " + " ".join(p.name.split()[:2]) + " ") for p in compiler.PASSES]
    assert all(i >= 0 for i in at), [p.name for p, i in zip(compiler.PASSES, at, strict=True) if i < 0]
    assert at == sorted(at), [p.name for p in compiler.PASSES]


def test_generated_kernels_keep_their_default_launch_without_memory_to_tune(monkeypatch, tiny_plan):
    # compiling on a GPU that a run already fills: a kernel whose tuning inputs cannot be allocated
    # keeps its default launch, and the compile says so instead of failing
    from types import SimpleNamespace

    from mtc.kernels import codegen

    prog, _, compiled = tiny_plan
    tid, ct = next((t, c) for t, c in compiled.items() if prog.templates[t].kind == "block")

    def oom(v, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    tuned = []
    monkeypatch.setattr(compiler, "tuning_input", oom)
    monkeypatch.setattr(codegen.FusedKernel, "tune", lambda self, ins, **kw: tuned.append(self))
    w = SimpleNamespace(device=torch.device("cuda"), graphs=lambda: [ct.joint_graph], template=prog.templates[tid],
                        tuning_s=0.0, generated_choices=None)
    with pytest.warns(UserWarning, match="keep their default launch configuration"):
        compiler._tune_generated(w)
    assert tuned == [] and w.generated_choices.choices == {}
    assert any(getattr(n.target, "mode", None) in codegen.TUNED_MODES for n in ct.joint_graph.nodes)


@pytest.mark.gpu
def test_generated_kernels_launch_choices_are_timed_once_and_stored_on_gpu(tmp_path):
    # on CUDA a plan's column and rowcol kernels time their launch configurations while it
    # compiles; the record keeps the choices and a later load seeds them: nothing is timed again
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mtc.kernels import codegen

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build("tiny", n_layers=2, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1024, max_seq_len=512).to(torch.bfloat16)
    prog = trace(model, 2, 512)
    compiled = compile_program(prog, tmp_path, log=None)
    tid, block = next((tid, ct) for tid, ct in compiled.items() if prog.templates[tid].kind == "block")
    # the tuned kernels and the values they were timed on (compiled graphs keep their strides; loaded ones do not)
    tuned = {n.target.__name__: (n.target, [a.meta["val"] for a in n.args]) for n in block.joint_graph.nodes
             if n.op == "call_function" and getattr(n.target, "mode", None) in codegen.TUNED_MODES}
    assert tuned, "a block's backward has a norm's rowcol kernel"
    choices = block.tuning["generated"]["choices"]
    assert {k.split("/")[0] for k in choices} >= set(tuned)
    assert all(c in k.candidates(cuda=True) for name, (k, _) in tuned.items()
               for key, c in choices.items() if key.startswith(name + "/"))
    codegen._TUNER.best.clear()  # as a fresh process: only the records' seeds are known
    codegen._TUNER.seeded.clear()
    again = compile_program(prog, tmp_path, log=None)
    assert all(ct.loaded for ct in again.values())
    before = codegen.generated_tuning_seconds()
    loaded = {n.target.__name__: n.target for n in again[tid].joint_graph.nodes
              if n.op == "call_function" and getattr(n.target, "mode", None) in codegen.TUNED_MODES}
    assert set(loaded) == set(tuned)
    for name, (_, vals) in tuned.items():
        got = loaded[name].tune([tuning_input(v, torch.device("cuda")) for v in vals])
        assert got in loaded[name].candidates(cuda=True)
    assert codegen.generated_tuning_seconds() == before  # every choice came from the record
