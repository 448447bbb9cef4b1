"""Tracing into a Program: stage split, shared templates, binding, errors, meta-device presets."""

from __future__ import annotations

import pytest
import torch
from mtc.graphs.program import Program
from torch import nn

from mtc.errors import TraceError
from mtc.models.llama import Llama, preset
from mtc.tracer import LossModel, trace


def run_program(program: Program, params: dict[str, torch.Tensor], ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Execute a Program eagerly with every weight resident (the executor's logic without streaming)."""
    dev = ids.device
    batch = {"ids": ids, "targets": targets}
    carry, aux = None, []
    for call in program.layers:
        t = program.templates[call.template]
        args = []
        for inp in t.inputs:
            s = call.bindings[inp.name]
            args.append({"param": lambda: params[s.key], "batch": lambda: batch[s.key], "carry": lambda: carry,
                         "aux": lambda: aux[s.index], "const": lambda: program.constant_values[s.key]}[s.kind]())
        out = t.module(dev)(*args)
        if t.kind == "embed":
            carry, aux = out[0], list(out[1:])
        else:
            carry = out[0]
    return carry


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, Program]:
    torch.manual_seed(0)
    model = Llama(preset("tiny", n_layers=3))
    return model, trace(model, 2, 16)


def test_stages_and_shared_template(tiny):
    model, prog = tiny
    kinds = [prog.templates[c.template].kind for c in prog.layers]
    assert kinds == ["embed", "block", "block", "block", "head"]
    assert len({c.template for c in prog.layers[1:4]}) == 1, "identical blocks must share one template"
    assert len(prog.templates) == 3
    assert prog.n_params() == sum(p.numel() for p in model.parameters())
    # every parameter is bound exactly once, to its own layer
    bound = [k for c in prog.layers for k in c.param_keys()]
    assert sorted(bound) == sorted(k for k, _ in model.named_parameters())
    assert prog.layers[2].bindings["param_attn_wq_weight"].key == "layers.1.attn.wq.weight"
    # RoPE tables are computed once by the embed stage and fed to every block
    assert len(prog.aux) == 2 and all(c.bindings["aux_0"].kind == "aux" for c in prog.layers[1:4])


def test_flat_layout_decay_first(tiny):
    _, prog = tiny
    for layer in range(prog.n_layers):
        ps = prog.layer_params(layer)
        offs = 0
        for p in ps:
            assert p.offset == offs
            offs += p.numel
        flags = [p.decay for p in ps]
        assert flags == sorted(flags, reverse=True), "decayed parameters must form a prefix"
        assert prog.layer_decay_numel(layer) == sum(p.numel for p in ps if p.decay)


def test_program_matches_module_bitwise(tiny):
    model, prog = tiny
    ids = torch.randint(0, 256, (2, 16))
    tg = torch.randint(0, 256, (2, 16))
    loss = run_program(prog, dict(model.named_parameters()), ids, tg)
    ref = LossModel(model)(ids, tg)
    assert torch.equal(loss, ref)


def test_rebinding_weights_changes_result(tiny):
    model, prog = tiny
    ids = torch.randint(0, 256, (2, 16))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    a = run_program(prog, params, ids, ids)
    params["layers.2.mlp.w_down.weight"].mul_(3.0)
    b = run_program(prog, params, ids, ids)
    assert not torch.equal(a, b)


def test_meta_device_preset_traces_without_weights():
    with torch.device("meta"):
        model = Llama(preset("8b", n_layers=4))
    prog = trace(model, 1, 256)
    assert len(prog.templates) == 3
    assert prog.carry.shape == (1, 256, 4096)
    block = prog.templates[prog.layers[1].template]
    shapes = {i.role: i.spec.shape for i in block.inputs if i.kind == "param"}
    assert shapes["attn.wk.weight"] == (8 * 128, 4096)  # 8 KV heads of 128: GQA
    assert shapes["mlp.w_gate.weight"] == (14336, 4096)


def test_tied_embeddings_one_parameter():
    torch.manual_seed(0)
    model = Llama(preset("tiny", n_layers=2, tie_embeddings=True))
    prog = trace(model, 1, 8)
    assert "lm_head.weight" not in prog.params and "embed.weight" in prog.params
    head = prog.layers[-1]
    assert "embed.weight" in head.param_keys()
    assert prog.params["embed.weight"].layer == 0
    assert prog.last_backward_user()[0] == 0
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(run_program(prog, dict(model.named_parameters()), ids, ids), LossModel(model)(ids, ids))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # data-dependent Python control flow: untraceable
            return self.lin(x)
        return x


class _Toy(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([block(), block()])
        self.out = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_untraceable_module_is_named():
    with pytest.raises(TraceError) as e:
        trace(_Toy(_Gated), 1, 4)
    msg = str(e.value)
    assert "layers.0" in msg and "_Gated" in msg
    assert "torch.where" in msg  # says what to change


def test_custom_model_traces():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.nn.functional.gelu(self.lin(self.ln(x)))

    model = _Toy(Plain)
    prog = trace(model, 2, 4)
    ids = torch.randint(0, 16, (2, 4))
    assert torch.equal(run_program(prog, dict(model.named_parameters()), ids, ids), LossModel(model)(ids, ids))


def test_no_blocks_error():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids)

    with pytest.raises(TraceError, match="ModuleList"):
        trace(Flat(), 1, 2)


class _Drop(nn.Module):
    def __init__(self, p: float = 0.1, attn_p: float = 0.0) -> None:
        super().__init__()
        self.lin, self.drop, self.attn_p = nn.Linear(8, 8), nn.Dropout(p), attn_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unsqueeze(1)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.attn_p, is_causal=True)
        return x + self.drop(self.lin(a.squeeze(1)))


class _Stats(nn.Module):  # BatchNorm-like running statistics
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean((0, 1)))
        return x + self.lin(x)


class _Routed(nn.Module):  # top-1 routing that gathers the routed tokens: data-dependent sizes
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.expert = nn.Linear(8, 2), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 8)
        rows = torch.nonzero(self.gate(flat).argmax(-1) == 0).squeeze(-1)
        return x + torch.zeros_like(flat).index_add(0, rows, self.expert(flat[rows])).view_as(x)


def test_what_a_streamed_replay_would_get_wrong_is_refused_at_trace_time():
    # a random draw would differ in the backward's recompute: refused, named; p = 0 or eval mode pass
    for block, what in ((lambda: _Drop(p=0.1), "aten.dropout.default with dropout p=0.1"),
                        (lambda: _Drop(p=0.0, attn_p=0.2), "aten.scaled_dot_product_attention.default with dropout p=0.2")):
        with pytest.raises(TraceError, match=rf"module 'layers.0.*' draws random numbers in the forward \({what}\).*"
                           r"Set dropout probabilities to 0"):
            trace(_Toy(block), 2, 4)
    trace(_Toy(lambda: _Drop(p=0.0)), 2, 4)
    trace(_Toy(_Drop).eval(), 2, 4)

    class FunctionalDrop(_Drop):  # F.dropout's training defaults to True: eval mode does not stop it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.nn.functional.dropout(self.lin(x), 0.1)

    with pytest.raises(TraceError, match=r"F.dropout\(x, p\) drops in eval mode too: give it training=self.training"):
        trace(_Toy(FunctionalDrop).eval(), 2, 4)
    # a buffer updated in the forward (inside no_grad too) would be dropped every step

    class Counted(_Toy):
        def __init__(self) -> None:
            super().__init__(lambda: _Drop(p=0.0))
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(ids)

    with pytest.raises(TraceError, match=r"the forward updates buffers 'layers.0.ema', 'layers.1.ema' in place"):
        trace(_Toy(_Stats), 2, 4)
    with pytest.raises(TraceError, match=r"the forward updates buffer 'calls' in place"):
        trace(Counted(), 2, 4)
    # sizes that depend on the data cannot be compiled for one shape
    with pytest.raises(TraceError, match=r"module 'layers.0' makes a value whose size depends on the data "
                       r"\(aten.nonzero.default.*route a\s+mixture of experts densely"):
        trace(_Toy(_Routed), 2, 4)


def test_a_forward_that_writes_a_parameter_in_place_is_refused():
    # nn.Embedding(max_norm=...) renormalises the rows it looks up in place during the forward;
    # a run dropped the write (each layer runs as a pure function of its weights), so its
    # embedding drifted from torch's from the first step
    class Renormed(_Toy):
        def __init__(self) -> None:
            super().__init__(lambda: _Drop(p=0.0))
            self.emb = nn.Embedding(16, 8, max_norm=1.0)

    with pytest.raises(TraceError, match=r"the forward writes parameter 'emb.weight' in place .*Drop max_norm"):
        trace(Renormed(), 2, 4)
    trace(_Toy(lambda: _Drop(p=0.0)), 2, 4)  # the same model without max_norm


def test_frozen_parameters_are_laid_out_frozen_and_never_decay():
    model = _Toy(lambda: _Drop(p=0.0))
    model.emb.weight.requires_grad_(False)
    model.layers[1].lin.weight.requires_grad_(False)
    prog = trace(model, 2, 4)
    assert {k for k, p in prog.params.items() if p.frozen} == {"emb.weight", "layers.1.lin.weight"}
    assert not prog.params["emb.weight"].decay and prog.params["layers.0.lin.weight"].decay
    for layer in range(prog.n_layers):  # decayed parameters still first: decay is one slice
        flags = [p.decay for p in sorted(prog.layer_params(layer), key=lambda p: p.offset)]
        assert flags == sorted(flags, reverse=True)
    from mtc.graphs.serialize import program_from_dict, program_to_dict

    assert program_from_dict(program_to_dict(prog)).params == prog.params


def test_blocks_are_the_outermost_module_list_and_a_skip_past_a_block_is_named():
    class Experts(nn.Module):  # a dense mixture of 4 experts: a ModuleList longer than the 2 blocks
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.experts = nn.Linear(8, 4), nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.gate(x).softmax(-1)
            return x + sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))

    prog = trace(_Toy(Experts), 2, 4)
    assert prog.meta["blocks"] == "layers" and prog.n_layers == 4

    class Skip(_Toy):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            first = self.layers[0](self.emb(ids))
            return self.out(self.layers[1](first) + first)

    with pytest.raises(TraceError, match=r"the output of block 0 of layers \(\w+\) is used beyond the next block, by "
                       r"the head; .*skip connection past a block"):
        trace(Skip(lambda: _Drop(p=0.0)), 2, 4)


def test_when_a_longer_module_list_is_taken_for_the_blocks_the_error_names_it_and_the_way_out():
    class ValueEmbeds(_Toy):  # modded-nanogpt's value embeddings: 3 tables, 2 blocks
        def __init__(self) -> None:
            super().__init__(lambda: nn.Linear(8, 8))
            self.vembs = nn.ModuleList(nn.Embedding(16, 8) for _ in range(3))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for layer, ve in zip(self.layers, self.vembs, strict=False):
                x = layer(x) + ve(ids)
            return self.out(x)

    with pytest.raises(TraceError, match=r"top-level code runs between blocks .*\(mtc took 'vembs', the longest nn.ModuleList, "
                                         r"for the blocks; if they are in 'layers', trace with mtc.trace\(model, batch_size, "
                                         r"seq_len, blocks='layers'\)"):
        trace(ValueEmbeds(), 2, 4)
    with pytest.raises(TraceError, match=r"top-level code runs between blocks .*layers loop$"):  # named: no guess to doubt
        trace(ValueEmbeds(), 2, 4, blocks="layers")


def test_one_block_that_takes_two_hidden_state_like_values_is_told_what_can_tell_them_apart():
    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
            return x + self.lin(x0)

    class OneBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.out = nn.Embedding(16, 8), nn.ModuleList([Mix()]), nn.Linear(8, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x0 = self.emb(ids)
            x = x0 * 2.0
            for layer in self.layers:
                x = layer(x, x0)
            return self.out(x)

    # it advised taking "the embedding output as its first tensor argument", which the trace cannot see
    with pytest.raises(TraceError, match=r"\(2 candidates shaped like its output .*\); with one block there is no next "
                                         r"block .*give the model a second block"):
        trace(OneBlock(), 2, 4)


def test_a_forward_without_logits_in_its_output_says_what_to_return():
    class Dict(_Toy):
        def forward(self, ids: torch.Tensor) -> dict:
            return {"scores": super().forward(ids)}

    class Named(_Toy):
        def forward(self, ids: torch.Tensor) -> dict:
            return {"logits": super().forward(ids), "aux": ids}

    with pytest.raises(TraceError, match=r"Dict.forward returns a dict with keys 'scores', and mtc found no logits in "
                       r"it; return the logits"):
        trace(Dict(lambda: _Drop(p=0.0)), 2, 4)
    trace(Named(lambda: _Drop(p=0.0)), 2, 4)


def test_a_position_table_shorter_than_the_sequence_is_refused_at_trace_time():
    class Learned(_Toy):
        def __init__(self, rows: int) -> None:
            super().__init__(lambda: _Drop(p=0.0))
            self.pos = nn.Embedding(rows, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    with pytest.raises(TraceError, match=r"module 'pos' looks up rows 0..5 of a table of 4 rows .* make it at least 6 "
                       r"rows, or trace and train at seq_len <= 4"):
        trace(Learned(4), 2, 6)
    trace(Learned(6), 2, 6)


def test_an_auxiliary_loss_in_the_output_is_said_to_be_ignored():
    class Aux(_Toy):
        def forward(self, ids: torch.Tensor) -> tuple:
            logits = super().forward(ids)
            return logits, (self.out.weight ** 2).mean()

    with pytest.warns(UserWarning, match=r"Aux.forward returns a scalar that depends on the parameters at position 1 of "
                      r"its output \(an auxiliary loss\?\): mtc trains the\s+cross-entropy of the logits"):
        trace(Aux(lambda: _Drop(p=0.0)), 2, 4)


def test_the_data_dependent_size_check_sees_only_tensors_and_sizes():
    # some torch versions' free_unbacked_symbols assert on a str or dict node value instead of skipping it
    import torch

    from mtc.graphs.trace import _shaped

    t = torch.zeros(2)
    assert _shaped("x") is None and _shaped({"a": t}) is None and _shaped(3) is None
    assert _shaped([t, "x", (t, None, {"k": 1})]) == [t, [t]]


class _AddsIntoInput(nn.Module):  # eager torch trains this: relu saves its output, not x
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.lin(torch.relu(x))
        return x


def test_a_layer_that_writes_into_its_input_in_place_is_refused():
    # the executor keeps each layer's input to recompute the layer in the backward; a block that
    # wrote into it traced, then compiling (or the first backward) died in autograd with "a leaf
    # Variable that requires grad is being used in an in-place operation", naming nothing
    with pytest.raises(TraceError, match=r"module 'layers.0' writes in place into the hidden state it receives .*x = x \+"):
        trace(_Toy(_AddsIntoInput), 2, 4)


def test_a_sparse_embedding_is_refused():
    # nn.Embedding(sparse=True) makes a sparse gradient: training traced it, then died at the first
    # backward in the executor ('reshape is not implemented for sparse tensors'); AdamW (torch's
    # too) needs dense gradients
    class Sparse(_Toy):
        def __init__(self) -> None:
            super().__init__(lambda: _Drop(p=0.0))
            self.emb = nn.Embedding(16, 8, sparse=True)

    with pytest.raises(TraceError, match=r"module 'emb' is an nn.Embedding with sparse=True.*drop sparse=True"):
        trace(Sparse(), 2, 4)
