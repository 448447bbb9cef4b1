"""transformers' model classes trace as they are (random tiny configs, no downloads): the
templates' forward gives the module's logits, and one trains a step under mtc matching torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mtc.graphs.program import Program
from torch import fx

from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file
from mtc.runtime.state import read_params
from mtc.tracer import LossModel, trace
from mtc.train import train
from tests.reference import reference_train

tr = pytest.importorskip("transformers")

VOCAB = 96


def _tiny(name: str) -> torch.nn.Module:
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 64}
    torch.manual_seed(0)
    if name == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0))
    kv2 = {"num_key_value_heads": 2}
    cls, cfg, extra = {
        "llama": (tr.LlamaForCausalLM, tr.LlamaConfig, kv2),
        # Llama 3.x: rope frequencies rescaled by wavelength (seq 8 > the original 4 below)
        "llama3-rope": (tr.LlamaForCausalLM, tr.LlamaConfig,
                        {**kv2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 4}}),
        "mistral": (tr.MistralForCausalLM, tr.MistralConfig, kv2),
        "qwen2": (tr.Qwen2ForCausalLM, tr.Qwen2Config, kv2),
        "qwen3": (tr.Qwen3ForCausalLM, tr.Qwen3Config, {**kv2, "head_dim": 8}),  # RMSNorm of q and k per head
        "gemma": (tr.GemmaForCausalLM, tr.GemmaConfig, {"num_key_value_heads": 1, "head_dim": 8}),
        # logit soft-capping, and sliding-window layers alternating with global ones (window 4 < seq 8)
        "gemma2": (tr.Gemma2ForCausalLM, tr.Gemma2Config, {**kv2, "head_dim": 8, "sliding_window": 4}),
        "gemma3": (tr.Gemma3ForCausalLM, tr.Gemma3TextConfig, {**kv2, "head_dim": 8, "sliding_window": 4}),
        "phi": (tr.PhiForCausalLM, tr.PhiConfig, {}),
        "phi3": (tr.Phi3ForCausalLM, tr.Phi3Config, kv2),  # fused qkv and gate_up projections
        "olmo2": (tr.Olmo2ForCausalLM, tr.Olmo2Config, kv2),  # norms after attention and MLP, q/k norms
        "stablelm": (tr.StableLmForCausalLM, tr.StableLmConfig, kv2),  # partial rotary, LayerNorm
        "granite": (tr.GraniteForCausalLM, tr.GraniteConfig, kv2),  # scaled embeddings, residuals and logits
        "smollm3": (tr.SmolLM3ForCausalLM, tr.SmolLM3Config, kv2),  # some layers without RoPE
        # mixture of experts: top-2 of 4 experts per token, routed with data-dependent indexing
        "mixtral": (tr.MixtralForCausalLM, tr.MixtralConfig, {**kv2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    }[name]
    model = cls(cfg(**common, **extra, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return model


def _logits_program(program: Program, params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Run the templates (every weight resident) and return the logits the head's loss reads."""
    carry, aux = None, []
    batch = {"ids": ids, "targets": ids}
    for call in program.layers:
        t = program.templates[call.template]
        args = []
        for inp in t.inputs:
            s = call.bindings[inp.name]
            if s.kind == "carry":
                args.append(carry)
            elif s.kind == "aux":
                args.append(aux[s.index])
            else:
                args.append({"param": params, "batch": batch, "const": program.constant_values}[s.kind][s.key])
        gm = t.module("cpu")
        if t.kind == "head":  # the head ends in the loss: return what cross-entropy reads instead
            g = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target is torch.ops.aten.cross_entropy_loss.default:
                    g.output(env[n.args[0]])
                    break
                env[n] = g.node_copy(n, env.__getitem__)
            return fx.GraphModule(torch.nn.Module(), g)(*args)
        out = gm(*args)
        if t.kind == "embed":
            carry, aux = out[0], list(out[1:])
        else:
            carry = out[0]
    raise AssertionError("no head")


ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "olmo2",
         "stablelm", "granite", "smollm3", "mixtral", "gpt2"]


@pytest.mark.parametrize("name", ARCHS)
def test_transformers_class_traces_as_is(name):
    model = _tiny(name).eval()
    prog = trace(model, 2, 8)
    kinds = [prog.templates[c.template].kind for c in prog.layers]
    assert kinds == ["embed", "block", "block", "head"]
    assert len({c.template for c in prog.iter_blocks()}) == 1
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.reshape(-1, VOCAB).float()
        got = _logits_program(prog, dict(model.named_parameters()), ids)
        loss = LossModel(model)(ids, ids)
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    if name != "gpt2":  # rotary tables (computed under @torch.no_grad()) are aux values of the embed stage
        assert prog.aux, "the rotary cos/sin tables should cross from the embed stage to the blocks"
    del loss


def test_no_grad_region_is_inlined_and_keeps_its_semantics():
    # A @torch.no_grad() forward becomes a subgraph in torch.export's graph; the tracer inlines it
    # (before, the embed stage failed on it), detaching what it computes from a parameter so that
    # no gradient flows there, as in the module.
    from torch import nn

    from tests.graphs.test_trace import run_program

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(0.3))

        @torch.no_grad()
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.s.exp()

    class Res(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + super().forward(x)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.scale = nn.Embedding(16, 8), Scale()
            self.blocks = nn.ModuleList(Res(8, 8) for _ in range(2))
            self.out = nn.Linear(8, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids) + self.scale(ids)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    m = M()
    prog = trace(m, 2, 4)
    embed = prog.template_of(0)
    targets = {str(n.target) for n in embed.graph.nodes}
    assert "aten.detach.default" in targets and not any("wrap_with_set_grad_enabled" in t for t in targets)
    ids = torch.randint(0, 16, (2, 4))
    params = {k: v.detach().requires_grad_() for k, v in m.named_parameters()}
    loss = run_program(prog, params, ids, ids)
    torch.testing.assert_close(loss, LossModel(m)(ids, ids), rtol=0, atol=0)
    loss.backward()
    assert params["scale.s"].grad is None and params["emb.weight"].grad is not None


# unfused: the traced graphs as they are; fused: the compiler's generated kernels (interpreted on the
# CPU), on the classes whose blocks hold what the others do not: q/k norms, soft-capping with
# alternating windows, routed experts
@pytest.mark.parametrize(("name", "kernels"), [("llama", "unfused"), pytest.param("qwen3", "fused", marks=pytest.mark.slow),
                                               pytest.param("gemma2", "fused", marks=pytest.mark.slow),
                                               pytest.param("mixtral", "fused", marks=pytest.mark.slow)])
def test_hf_class_trains_two_steps_like_torch(tmp_path, name, kernels):
    res = _trains_like_torch(tmp_path, _tiny(name), kernels, steps=2, grad_accum=1)
    if kernels == "fused":  # every fusion group of the block got a generated kernel: nothing ran unfused
        blocks = [res.compiled[c.template] for c in res.program.iter_blocks()]
        assert blocks and all(0 < b.backward_report.generated == b.backward_report.groups for b in blocks)


def _trains_like_torch(tmp_path, model: torch.nn.Module, kernels: str, *, steps: int, grad_accum: int):
    """Train ``model`` under mtc and under torch's AdamW on the same tokens; assert losses and
    weights agree to 1e-5 relative; return mtc's (closed) result."""
    toks = np.random.default_rng(2).integers(0, VOCAB, 4_000).astype(np.uint16)
    tf = write_token_file(tmp_path / "t.bin", toks, vocab_size=VOCAB, tokenizer="byte")
    cfg = TrainConfig(steps=steps, micro_batch_size=2, seq_len=8, grad_accum=grad_accum, kernels=kernels,
                      optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, clip_norm=1.0))
    ref_losses, ref_weights = reference_train(cfg, tf, model=copy.deepcopy(model))
    res = train(cfg, None, tf, model=model)
    try:
        for a, b in zip(res.losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5 * b
        got = read_params(res.program, res.store, res.generation)
        for k, v in ref_weights.items():
            assert ((got[k] - v).norm() / v.norm()).item() < 1e-5, k
    finally:
        res.store.close()
    return res


class _X0Block(torch.nn.Module):
    """modded-nanogpt's block: mixes the embedding output x0 back in at every block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lam = torch.nn.Parameter(torch.full((2,), 0.5))
        self.norm, self.mlp = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        x = self.lam[0] * x + self.lam[1] * x0
        return x + self.mlp(self.norm(x))


class _X0LM(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.ModuleList(_X0Block(d) for _ in range(3))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = x0 = self.tok(ids)  # one tensor: the hidden state and a value every block reads
        for b in self.blocks:
            x = b(x, x0)
        return self.head(x)


@pytest.mark.parametrize("kernels", ["unfused", pytest.param("fused", marks=pytest.mark.slow)])
def test_the_embedding_output_as_hidden_state_and_as_every_blocks_input_trains_like_torch(tmp_path, kernels):
    # it was refused: "blocks.1 uses embedding ... computed in the embedding stage; only the hidden
    # state and values computed before the first block may cross layer boundaries" (it was both)
    torch.manual_seed(0)
    res = _trains_like_torch(tmp_path, _X0LM(), kernels, steps=3, grad_accum=2)
    assert len(res.program.aux) == 1  # x0, beside the carry
