"""Shared check for compiled templates: the fused graphs against the ATen template on the CPU."""

from __future__ import annotations

import torch

from mtc.compiler import compile_template
from mtc.graphs.program import joint_keeps_outputs


def graph_targets(graph: torch.fx.Graph) -> set[str]:
    """Names of every op (and fused-kernel function) a compiled graph calls."""
    return {str(n.target) for n in graph.nodes if n.op == "call_function"}


def check_compiled(prog, params, call, tmp_path, **compile_kw):
    """Compile ``call``'s template; its forward and joint graphs must match the ATen template."""
    t = prog.templates[call.template]
    ct = compile_template(t, tmp_path, **compile_kw)
    # kernels are generated wherever there are fusion groups (a plain linear + CE head has none
    # left: the fused CE op computes its gradients)
    for rep in (ct.forward_report, ct.backward_report):
        assert rep.generated > 0 or rep.groups == 0, rep
    aux = [torch.randn(a.shape) for a in prog.aux]
    args = []
    for inp in t.inputs:
        src = call.bindings[inp.name]
        if src.kind == "param":
            args.append(params[src.key].detach())
        elif src.kind == "aux":
            args.append(aux[src.index])
        elif src.kind == "batch":
            targets = torch.randint(0, 256, inp.spec.shape)
            targets.view(-1)[1] = -100  # an ignored position
            args.append(targets)
        else:
            args.append(torch.randn(inp.spec.shape))
    ref = t.module("cpu")(*args)[0]
    torch.testing.assert_close(ct.module("forward", "cpu")(*args)[0], ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    xs = [a.clone().requires_grad_(k in ct.diff) for k, a in enumerate(args)]
    want = torch.autograd.grad(t.module("cpu")(*xs)[0], [xs[k] for k in ct.diff], g)
    outs = ct.module("joint", "cpu")(*args, g)
    keeps = compile_kw.get("joint_outputs")
    if joint_keeps_outputs(t) if keeps is None else keeps:  # a head's loss is read in the backward visit
        torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
    else:  # a block's output is not: the joint graph leaves it out
        assert outs[0] is None
    for k, a, b in zip(ct.diff, outs[1:], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{t.kind} grad of {t.inputs[k].role}: {m}")
    if t.kind == "block" and compile_kw.get("split", True):  # the split pair: the forward that saves, the backward from it
        assert ct.save_graph is not None, ct.split_note
        saved = ct.module("save", "cpu")(*args)
        torch.testing.assert_close(saved[0], ref, rtol=1e-5, atol=1e-5)
        kept = saved[1 + t.n_aux_out:]
        assert [(tuple(s.shape), s.dtype) for s in kept] == ct.saved and 0 < ct.saved_bytes()
        split = ct.module("backward", "cpu")(*args, *kept, g)
        assert all(o is None for o in split[:1 + t.n_aux_out])
        for k, a, b in zip(ct.diff, split[1 + t.n_aux_out:], outs[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"split backward, grad of {t.inputs[k].role}: {m}")
    return ct
