"""Hugging Face import and export against transformers itself, on tiny random models saved locally.

Each architecture mtc imports (Llama with llama3 rope scaling, Mistral, Qwen2, GPT-2; tied and
untied heads, GQA, biases, sharded and single-file saves) must give the same logits in mtc as in
transformers, and export back bit for bit. Training an import and exporting it must load in
transformers with mtc's logits; bad checkpoints fail in one line before anything is written.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mtc.store import TensorStore, state_array_name
from safetensors import safe_open
from safetensors.torch import save_file

from mtc.cli import main
from mtc.data import write_token_file
from mtc.hf import export_hf, import_hf
from mtc.models import build
from mtc.warmstart import init_from, load_state_dict

tf = pytest.importorskip("transformers")

VOCAB = 260  # above the byte tokenizer's 256, so byte-level token files fit


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight random (norm scales around one), so biases and norms are tested too."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if is_norm and name.endswith("weight") else 0.0))
    return model.eval()


def _llama_like(kind: str, *, tie: bool = False, **kw: object) -> torch.nn.Module:
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": tie, "rms_norm_eps": 1e-5}
    if kind == "llama":
        return _randomize(tf.LlamaForCausalLM(tf.LlamaConfig(**common, **kw)))
    if kind == "mistral":
        return _randomize(tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=48, **kw)))
    return _randomize(tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **kw)))


def _gpt2(*, tie: bool = True) -> torch.nn.Module:
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tie,
                        bos_token_id=0, eos_token_id=0)
    return _randomize(tf.GPT2LMHeadModel(cfg))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    # sharded save (many small files + index), GQA, Llama 3.1 rope scaling, untied head
    "llama-llama3-sharded": (lambda: _llama_like("llama", rope_scaling=LLAMA3), "20KB"),
    "llama-tied-biases": (lambda: _llama_like("llama", tie=True, attention_bias=True, mlp_bias=True,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0}), None),
    "mistral": (lambda: _llama_like("mistral"), "30KB"),
    "qwen2-tied": (lambda: _llama_like("qwen2", tie=True), None),
    "gpt2-tied": (lambda: _gpt2(tie=True), "20KB"),
    "gpt2-untied": (lambda: _gpt2(tie=False), None),
}


def _save(model: torch.nn.Module, path, shard: str | None) -> None:
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))


def _mtc_model(run) -> torch.nn.Module:
    """mtc's own module of the run's model, holding the run's committed weights."""
    with TensorStore.open(run, read_only=True) as st:
        cfg = st.last_commit().config
    model = build(cfg["model"], **cfg["model_overrides"]).eval()
    sd = load_state_dict(run)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(sd[name])
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def _hf_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 -- safe_open is not a dict
    return out


# two cases that cover mtc's own extensions (o/MLP biases, linear rope, untied GPT-2) run with the slow tests
_SLOW = {"llama-tied-biases", "gpt2-untied"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW else c for c in CASES])
def test_import_matches_transformers_and_export_round_trips_bit_for_bit(tmp_path, case):
    make, shard = CASES[case]
    hf = make()
    _save(hf, tmp_path / "hf", shard)
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
        got = _mtc_model(tmp_path / "run")(ids)
    assert _rel(want, got) <= 1e-5, (case, _rel(want, got))

    out = export_hf(tmp_path / "run", tmp_path / "out", max_shard_bytes=40_000)
    assert len(out.shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    orig, back = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "out")
    if res.model_overrides["tie_embeddings"]:
        orig.pop("lm_head.weight", None)  # a tied head is the embedding: neither side needs to store it
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert back[k].dtype == torch.float32 and torch.equal(orig[k], back[k]), k
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)


def _tokens(path, n=20_000):
    ids = np.random.default_rng(0).integers(0, 256, n).astype(np.uint16)
    return write_token_file(path, ids, vocab_size=256, tokenizer="byte").path


def _tokenizer_files(d) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def test_cli_import_train_export_loads_in_transformers_with_mtcs_logits(tmp_path, capsys):
    hf = _llama_like("qwen2")  # q/k/v biases, GQA, untied
    _save(hf, tmp_path / "hf", "20KB")
    _tokenizer_files(tmp_path / "hf")
    run, data = tmp_path / "run", tmp_path / "d.bin"
    assert main(["import", str(tmp_path / "hf"), "--store", str(run)]) == 0
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    # the run holds its tokenizer: only data made by it trains the run (byte data is refused)
    code = main(["train", "--store", str(run), "--data", str(_tokens(tmp_path / "bytes.bin")), "--steps", "3", "--unfused",
                 "--micro-batch-size", "1", "--seq-len", "64"])
    assert code == 2 and "not by the run's tokenizer" in capsys.readouterr().err
    # a run started from this one (--init-from RUN) holds the tokenizer too, and refuses alike
    code = main(["train", "--store", str(tmp_path / "warm"), "--init-from", str(run), "--data",
                 str(_tokens(tmp_path / "bytes.bin")), "--steps", "3", "--unfused", "--micro-batch-size", "1",
                 "--seq-len", "64"])
    assert code == 2 and "not by the run's tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "warm").exists()  # refused before the new store was seeded
    (tmp_path / "text.txt").write_text("hello world hello hello world\n" * 3000)
    assert main(["prepare", str(tmp_path / "text.txt"), "-o", str(data), "--tokenizer", str(run / "tokenizer"), "--eos", "[UNK]"]) == 0
    assert main(["verify", str(run)]) == 0  # zero Adam state is written: a healthy store
    before = load_state_dict(run)
    # no --preset: the model comes from the store
    code = main(["train", "--store", str(run), "--data", str(data), "--steps", "3", "--unfused",
                 "--micro-batch-size", "1", "--seq-len", "64", "--lr", "1e-3", "--warmup-steps", "0"])
    assert code == 0, capsys.readouterr().err
    after = load_state_dict(run)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "out"), "--max-shard-size", "30KB"]) == 0
    assert "3 shard" in capsys.readouterr().out or len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "generation_config.json").is_file()
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine, theirs = _mtc_model(run)(ids), loaded(ids).logits
    assert _rel(mine, theirs) <= 1e-5
    # bf16 export: the weights rounded once
    assert main(["export", str(run), "-o", str(tmp_path / "bf"), "--dtype", "bfloat16"]) == 0
    bf = _hf_tensors(tmp_path / "bf")
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
    assert torch.equal(bf["model.norm.weight"], after["norm.weight"].to(torch.bfloat16))
    # steps: the last two commits are kept; another is named with the available ones
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "x"), "--step", "99"]) == 2
    err = capsys.readouterr().err
    assert "step 99 is not available" in err and "available: " in err and err.rstrip().endswith("3 (a store keeps the "
                                                                                               "weights of its last two commits)"), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    # an output directory that cannot be made (here under a regular file): one line, not a traceback
    (tmp_path / "a-file").write_text("")
    assert main(["export", str(run), "-o", str(tmp_path / "a-file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtc: error: cannot write the checkpoint at ") and "choose another -o directory" in err, err
    assert f"{tmp_path / 'a-file'};" in err, err  # it names what is in the way


def _cli_error(capsys, argv):
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("mtc: error: "), err
    return err


def test_unsupported_architecture_missing_and_misshaped_tensors_fail_before_writing(tmp_path, capsys):
    hf = tmp_path / "hf"
    _save(_llama_like("llama"), hf, None)
    cfg = json.loads((hf / "config.json").read_text())
    store = tmp_path / "run"

    (hf / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    err = _cli_error(capsys, ["import", str(hf), "--store", str(store)])
    assert "FalconForCausalLM" in err and "not supported" in err
    assert not store.exists()

    (hf / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}))
    err = _cli_error(capsys, ["import", str(hf), "--store", str(store)])
    assert "yarn" in err and not store.exists()

    (hf / "config.json").write_text(json.dumps(cfg))
    with safe_open(str(hf / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    gone = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    err = _cli_error(capsys, ["import", str(hf), "--store", str(store)])
    assert gone in err and "missing" in err and not store.exists()

    bad = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)})
    save_file(bad, str(hf / "model.safetensors"), metadata={"format": "pt"})
    err = _cli_error(capsys, ["import", str(hf), "--store", str(store)])
    assert "model.layers.0.self_attn.k_proj.weight" in err and "[32, 32]" in err and "[16, 32]" in err
    assert not store.exists()

    # a store path under a file (once "I/O error (Not a directory); check the disk (dmesg)")
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "afile").write_text("x")
    err = _cli_error(capsys, ["import", str(hf), "--store", str(tmp_path / "afile" / "sub")])
    assert f"{tmp_path / 'afile'}, a parent of {tmp_path / 'afile' / 'sub'}, is a file, not a directory; " \
           f"move {tmp_path / 'afile'} away" in err and "dmesg" not in err, err


def test_init_from_a_run_and_from_hf_starts_with_its_weights_and_fresh_moments(tmp_path, capsys):
    hf = tmp_path / "hf"
    _save(_gpt2(), hf, None)
    data = _tokens(tmp_path / "d.bin")
    src = tmp_path / "src"
    common = ["--data", str(data), "--unfused", "--micro-batch-size", "2", "--seq-len", "16"]
    # from a Hugging Face directory, in one command
    assert main(["train", "--store", str(src), "--init-from", str(hf), "--steps", "2", *common]) == 0, capsys.readouterr().err
    with TensorStore.open(src, read_only=True) as st:
        hist = st.commit_history()
        assert hist[0].step == 0 and hist[0].meta["init"]["kind"] == "hf" and st.last_commit().step == 2
    # from a run: its last weights, zero moments, then train on
    from mtc.config import TrainConfig
    from mtc.warmstart import run_model

    cfg = TrainConfig(**run_model(src), micro_batch_size=2, seq_len=16)
    init_from(src, tmp_path / "new", cfg)
    a, b = load_state_dict(src), load_state_dict(tmp_path / "new")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with TensorStore.open(tmp_path / "new", read_only=True) as st:
        assert st.last_commit().step == 0
        assert not st.read(state_array_name(1, "m", 0)).any() and not st.read(state_array_name(1, "v", 0)).any()
    # what the source run knew of its Hugging Face origin comes along (export's architecture, EOS ids)
    assert (tmp_path / "new" / "hf" / "config.json").read_bytes() == (src / "hf" / "config.json").read_bytes()
    if (src / "tokenizer").is_dir():
        assert sorted(p.name for p in (tmp_path / "new" / "tokenizer").iterdir()) == \
            sorted(p.name for p in (src / "tokenizer").iterdir())
    # the same command again resumes the seeded store instead of refusing it
    argv = ["train", "--store", str(tmp_path / "new"), "--init-from", str(src), "--steps", "2", *common]
    assert main(argv) == 0, capsys.readouterr().err
    with TensorStore.open(tmp_path / "new", read_only=True) as st:
        assert st.last_commit().step == 2 and st.attributes()["mtc_init"]["kind"] == "run"
    # another model than the source's is refused, before anything is written
    err = _cli_error(capsys, ["train", "--store", str(tmp_path / "other"), "--init-from", str(src), "--preset", "tiny",
                              "--steps", "2", *common])
    assert "gpt2" in err and not (tmp_path / "other").exists()
