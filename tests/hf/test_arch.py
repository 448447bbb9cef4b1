"""Hugging Face config.json <-> mtc model fields: what each architecture's config really means."""

from __future__ import annotations

from mtc.hf.arch import from_hf_config, to_hf_config

BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256}


def _cfg(model_type: str, arch: str, **kw: object) -> dict:
    return {**BASE, "model_type": model_type, "architectures": [arch], **kw}


def test_only_llama_reads_attention_and_mlp_bias():
    # transformers' Mistral hard-codes bias=False; Qwen2 has q/k/v biases and nothing else
    _, _, m = from_hf_config(_cfg("mistral", "MistralForCausalLM", attention_bias=True, mlp_bias=True))
    assert (m["qkv_bias"], m["out_bias"], m["mlp_bias"]) == (False, False, False)
    _, _, q = from_hf_config(_cfg("qwen2", "Qwen2ForCausalLM", attention_bias=True, mlp_bias=True))
    assert (q["qkv_bias"], q["out_bias"], q["mlp_bias"]) == (True, False, False)
    _, _, ll = from_hf_config(_cfg("llama", "LlamaForCausalLM", attention_bias=True, mlp_bias=True))
    assert (ll["qkv_bias"], ll["out_bias"], ll["mlp_bias"]) == (True, True, True)


def test_a_sliding_window_caps_the_context_only_where_a_layer_slides():
    _, _, m = from_hf_config(_cfg("mistral", "MistralForCausalLM", sliding_window=48))
    assert m["max_seq_len"] == 48
    # Qwen2 slides on the layers from max_window_layers on: none when that is every layer
    none = _cfg("qwen2", "Qwen2ForCausalLM", sliding_window=48, use_sliding_window=True, max_window_layers=2)
    assert from_hf_config(none)[2]["max_seq_len"] == 256
    some = _cfg("qwen2", "Qwen2ForCausalLM", sliding_window=48, use_sliding_window=True, max_window_layers=1)
    _, family, f = from_hf_config(some)
    assert f["max_seq_len"] == 48
    # the export keeps the checkpoint's own max_position_embeddings (the cap is mtc's, not the model's)
    full = {**f, "init_std": 0.02, "rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-6}
    assert to_hf_config(family, full, some, "float32")["max_position_embeddings"] == 256
    assert to_hf_config(family, full, None, "float32")["max_position_embeddings"] == 48
