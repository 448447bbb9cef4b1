"""Hugging Face architectures <-> mtc's model families: config fields and tensor names.

`from_hf_config` turns a ``config.json`` into an mtc model family and the shape fields that
go into ``model_overrides``, refusing (with the field named) anything mtc's models would compute
differently. `to_hf_config` does the reverse for export. `tensor_map` lists, for one model, each
Hugging Face tensor name with the mtc parameter it is and whether it is stored transposed
(GPT-2 keeps its projections as Conv1D weights, ``(in, out)``, where mtc has ``nn.Linear``'s
``(out, in)``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mtc.errors import CheckpointError

__all__ = ["ARCHITECTURES", "TensorName", "from_hf_config", "ignorable", "tensor_map", "to_hf_config"]

# architecture (config.json "architectures") -> (model_type, mtc family)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "llama"),
    "GPT2LMHeadModel": ("gpt2", "gpt2"),
}
_BY_TYPE = {mt: arch for arch, (mt, _f) in ARCHITECTURES.items()}

# buffers some checkpoints carry that are not weights (recomputed by every implementation)
_IGNORABLE = re.compile(r"(.*\.)?(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def ignorable(name: str) -> bool:
    """Whether a checkpoint tensor is a non-weight buffer that import skips."""
    return _IGNORABLE.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True, slots=True)
class TensorName:
    """A Hugging Face tensor and the mtc parameter it holds."""

    hf: str
    mtc: str
    transposed: bool = False


def architecture(cfg: dict[str, Any]) -> str:
    """The supported architecture a config.json names; CheckpointError naming it otherwise."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, list) and archs:
        arch = str(archs[0])
    elif cfg.get("model_type") in _BY_TYPE:
        arch = _BY_TYPE[cfg["model_type"]]
    else:
        arch = str(cfg.get("model_type") or "unknown (config.json names no architectures or model_type)")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"architecture {arch} is not supported; mtc imports {', '.join(ARCHITECTURES)}")
    return arch


def _need(cfg: dict[str, Any], key: str, arch: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json of this {arch} checkpoint has no {key!r}")
    return cfg[key]


def _refuse(arch: str, what: str) -> CheckpointError:
    return CheckpointError(f"{arch} checkpoint: {what} is not supported by mtc's model")


def _rope(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """mtc's rope fields from either config format: transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` plus ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise _refuse(arch, "per-layer rope_parameters")
    src = dict(params) if isinstance(params, dict) else dict(scaling) if isinstance(scaling, dict) else {}
    theta = src.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = src.get("rope_type", src.get("type", "default")) or "default"
    if float(src.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise _refuse(arch, "partial_rotary_factor")
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(src["factor"])}
    if kind == "llama3":
        try:
            return {**out, "rope_scaling": "llama3", "rope_factor": float(src["factor"]),
                    "rope_low_freq_factor": float(src["low_freq_factor"]),
                    "rope_high_freq_factor": float(src["high_freq_factor"]),
                    "rope_original_max_seq_len": int(src["original_max_position_embeddings"])}
        except KeyError as e:
            raise CheckpointError(f"{arch} checkpoint: llama3 rope scaling lacks {e.args[0]!r}") from None
    raise _refuse(arch, f"rope type {kind!r} (mtc implements default, linear and llama3)")


def _window(cfg: dict[str, Any], model_type: str | None) -> int | None:
    """The sliding attention window a config puts on some layer, or None: Mistral's
    ``sliding_window``; Qwen2's with ``use_sliding_window``, on the layers from
    ``max_window_layers`` on (none when that is every layer)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if model_type == "mistral":
        return int(window)
    if cfg.get("use_sliding_window") and int(cfg.get("max_window_layers", 0)) < int(cfg.get("num_hidden_layers", 0)):
        return int(window)
    return None


def from_hf_config(cfg: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(architecture, mtc family, model_overrides) of a Hugging Face config.json's contents."""
    arch = architecture(cfg)
    model_type, family = ARCHITECTURES[arch]
    if family == "gpt2":
        return arch, family, _gpt2_fields(cfg, arch)
    hidden, heads = int(_need(cfg, "hidden_size", arch)), int(_need(cfg, "num_attention_heads", arch))
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise _refuse(arch, f"head_dim {head_dim} with hidden_size {hidden} and {heads} heads (mtc uses hidden_size / heads)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(arch, f"hidden_act {act!r} (mtc's MLP is SwiGLU with silu)")
    max_len = int(cfg.get("max_position_embeddings", 2048))
    # mtc attends to the whole causal prefix: a sliding window is exact for sequences within it
    window = _window(cfg, model_type)
    if window is not None:
        max_len = min(max_len, window)
    # only Llama's config reads attention_bias / mlp_bias (Mistral's layers have no biases whatever
    # the config says; Qwen2's q, k and v always have one, its o and MLP none)
    bias = bool(cfg.get("attention_bias", False)) if model_type == "llama" else False
    out: dict[str, Any] = {
        "vocab_size": int(_need(cfg, "vocab_size", arch)), "dim": hidden,
        "n_layers": int(_need(cfg, "num_hidden_layers", arch)), "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads), "ffn_dim": int(_need(cfg, "intermediate_size", arch)),
        "max_seq_len": max_len, "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": model_type == "qwen2" or bias, "out_bias": bias,
        "mlp_bias": bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        "init_std": float(cfg.get("initializer_range", 0.02)),
    }
    return arch, family, {**out, **_rope(cfg, arch)}


def _gpt2_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    dim = int(_need(cfg, "n_embd", arch))
    if cfg.get("n_inner") not in (None, 4 * dim):
        raise _refuse(arch, f"n_inner {cfg['n_inner']} (mtc's GPT-2 MLP is 4 * n_embd = {4 * dim} wide)")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse(arch, f"activation_function {act!r} (mtc's GPT-2 uses the tanh GELU, gelu_new)")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                    ("add_cross_attention", False)):
        if bool(cfg.get(key, ok)) != ok:
            raise _refuse(arch, f"{key}={cfg[key]}")
    return {"vocab_size": int(_need(cfg, "vocab_size", arch)), "dim": dim, "n_layers": int(_need(cfg, "n_layer", arch)),
            "n_heads": int(_need(cfg, "n_head", arch)), "max_seq_len": int(cfg.get("n_positions", 1024)),
            "norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)), "init_std": float(cfg.get("initializer_range", 0.02)),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True))}


def to_hf_config(family: str, f: dict[str, Any], base: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """A config.json for model family ``family`` with fields ``f`` (a full mtc config as a dict).

    ``base`` (the config.json the run was imported from, if any) keeps its other keys (token ids,
    dropout, ...); the shape keys are always written from ``f``.
    """
    out = dict(base or {})
    for stale in ("torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        out.pop(stale, None)
    if base is None:  # mtc's own run: its token ids are unknown here (transformers' defaults may not even fit the vocabulary)
        out.update({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    if family == "gpt2":
        out.setdefault("architectures", ["GPT2LMHeadModel"])
        out.update({"model_type": "gpt2", "vocab_size": f["vocab_size"], "n_embd": f["dim"], "n_layer": f["n_layers"],
                    "n_head": f["n_heads"], "n_positions": f["max_seq_len"], "n_inner": None,
                    "layer_norm_epsilon": f["norm_eps"], "activation_function": "gelu_new",
                    "tie_word_embeddings": f["tie_embeddings"], "initializer_range": f["init_std"]})
        out.update({"architectures": ["GPT2LMHeadModel"], "torch_dtype": dtype})
        return out
    arch = (base or {}).get("architectures", [None])[0]
    if arch not in ARCHITECTURES or ARCHITECTURES[arch][1] != "llama":
        # a run of mtc's own: Qwen2 is Llama with biases on q, k and v only; Llama's attention_bias covers o as well
        arch = "Qwen2ForCausalLM" if f["qkv_bias"] and not f["out_bias"] else "LlamaForCausalLM"
    if arch == "Qwen2ForCausalLM" and (f["out_bias"] or f["mlp_bias"] or not f["qkv_bias"]):
        raise CheckpointError("a Qwen2 model has biases on q, k and v only; this run's biases differ, so it has no HF form")
    if arch != "Qwen2ForCausalLM" and f["qkv_bias"] != f["out_bias"]:
        raise CheckpointError("Llama's attention_bias puts a bias on q, k, v and o together; this run has "
                              f"qkv_bias={f['qkv_bias']}, out_bias={f['out_bias']}, which transformers cannot express")
    out.update({"architectures": [arch], "model_type": ARCHITECTURES[arch][0], "vocab_size": f["vocab_size"],
                "hidden_size": f["dim"], "num_hidden_layers": f["n_layers"], "num_attention_heads": f["n_heads"],
                "num_key_value_heads": f["n_kv_heads"], "intermediate_size": f["ffn_dim"], "head_dim": f["dim"] // f["n_heads"],
                "rms_norm_eps": f["norm_eps"], "tie_word_embeddings": f["tie_embeddings"], "hidden_act": "silu",
                "initializer_range": f["init_std"], "torch_dtype": dtype})
    if base is None or _window(base, base.get("model_type")) is None:  # (a window capped max_seq_len: keep the config's)
        out["max_position_embeddings"] = f["max_seq_len"]
    if arch != "Qwen2ForCausalLM":
        out.update({"attention_bias": f["out_bias"], "mlp_bias": f["mlp_bias"]})
    rope: dict[str, Any] = {"rope_theta": f["rope_theta"], "rope_type": "default"}
    if f["rope_scaling"] == "linear":
        rope.update(rope_type="linear", factor=f["rope_factor"])
    elif f["rope_scaling"] == "llama3":
        rope.update(rope_type="llama3", factor=f["rope_factor"], low_freq_factor=f["rope_low_freq_factor"],
                    high_freq_factor=f["rope_high_freq_factor"], original_max_position_embeddings=f["rope_original_max_seq_len"])
    # both spellings: transformers >= 5 reads rope_parameters, 4.x rope_theta and rope_scaling
    out.pop("rope_parameters", None)
    out["rope_theta"] = f["rope_theta"]
    out["rope_scaling"] = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_parameters"] = rope
    return out


def tensor_map(family: str, f: dict[str, Any], *, prefix: str = "") -> list[TensorName]:
    """Every Hugging Face tensor of a model of ``family`` with fields ``f``, with its mtc parameter, in
    layer order. ``prefix`` ("" or "transformer.") is GPT-2's: its hub checkpoints come both ways."""
    out: list[TensorName] = []
    if family == "gpt2":
        p = prefix
        out += [TensorName(f"{p}wte.weight", "wte.weight"), TensorName(f"{p}wpe.weight", "wpe.weight")]
        for i in range(f["n_layers"]):
            h, m = f"{p}h.{i}.", f"layers.{i}."
            out += [TensorName(h + "ln_1.weight", m + "ln1.weight"), TensorName(h + "ln_1.bias", m + "ln1.bias"),
                    TensorName(h + "attn.c_attn.weight", m + "c_attn.weight", True), TensorName(h + "attn.c_attn.bias", m + "c_attn.bias"),
                    TensorName(h + "attn.c_proj.weight", m + "c_proj.weight", True), TensorName(h + "attn.c_proj.bias", m + "c_proj.bias"),
                    TensorName(h + "ln_2.weight", m + "ln2.weight"), TensorName(h + "ln_2.bias", m + "ln2.bias"),
                    TensorName(h + "mlp.c_fc.weight", m + "c_fc.weight", True), TensorName(h + "mlp.c_fc.bias", m + "c_fc.bias"),
                    TensorName(h + "mlp.c_proj.weight", m + "mlp_proj.weight", True),
                    TensorName(h + "mlp.c_proj.bias", m + "mlp_proj.bias")]
        out += [TensorName(f"{p}ln_f.weight", "ln_f.weight"), TensorName(f"{p}ln_f.bias", "ln_f.bias")]
        if not f["tie_embeddings"]:
            out.append(TensorName("lm_head.weight", "lm_head.weight"))
        return out
    out.append(TensorName("model.embed_tokens.weight", "embed.weight"))
    for i in range(f["n_layers"]):
        h, m = f"model.layers.{i}.", f"layers.{i}."
        out.append(TensorName(h + "input_layernorm.weight", m + "attn_norm.weight"))
        for hf, mt in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
            out.append(TensorName(f"{h}self_attn.{hf}_proj.weight", f"{m}attn.{mt}.weight"))
            if f["qkv_bias"] if hf != "o" else f["out_bias"]:
                out.append(TensorName(f"{h}self_attn.{hf}_proj.bias", f"{m}attn.{mt}.bias"))
        out.append(TensorName(h + "post_attention_layernorm.weight", m + "mlp_norm.weight"))
        for hf, mt in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            out.append(TensorName(f"{h}mlp.{hf}_proj.weight", f"{m}mlp.{mt}.weight"))
            if f["mlp_bias"]:
                out.append(TensorName(f"{h}mlp.{hf}_proj.bias", f"{m}mlp.{mt}.bias"))
    out.append(TensorName("model.norm.weight", "norm.weight"))
    if not f["tie_embeddings"]:
        out.append(TensorName("lm_head.weight", "lm_head.weight"))
    return out
