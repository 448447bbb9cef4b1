"""`mtc prepare --tokenizer` and `mtc train`: data from another tokenizer than the model's is refused
in one line, before anything is written, and a resumed run cannot switch tokenizers."""

from __future__ import annotations

import json

from mtc.store import TensorStore

from mtc.cli import main
from tests.data.tok_util import SENTENCES, bpe_dir
from tests.runtime.engine_util import small_config


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


def test_prepare_then_train_refuses_a_tokenizer_that_does_not_match(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n".join(SENTENCES * 3))
    tok_a, tok_b = bpe_dir(tmp_path, name="tok_a"), bpe_dir(tmp_path, vocab_size=290, name="tok_b")
    code, out, err = _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / "a.bin", "--tokenizer", tok_a)
    assert code == 0 and not err and "1 documents" in out and "tokenizer tok_a, vocab 300, EOS 0" in out, out
    assert (tmp_path / "a.tokenizer" / "tokenizer.json").is_file()
    assert _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / "b.bin", "--tokenizer", tok_b)[0] == 0
    # writing over a token file is said, not silent
    code, _, err = _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / "b.bin", "--tokenizer", tok_b)
    assert code == 0 and err == [f"note: replaced the token file that was at {tmp_path / 'b.bin'}"], err

    # the tiny model embeds 256 ids; the tokenizer has 300
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=1).to_dict()))
    code, _, err = _run(capsys, "train", "--config", cfg, "--store", tmp_path / "s0", "--data", tmp_path / "a.bin")
    assert code == 2 and len(err) == 1 and err[0].startswith("mtc: error: token file") and "model_overrides.vocab_size" in err[0]
    assert not (tmp_path / "s0").exists()

    # a model of 320 ids trains on it; resuming on data from another tokenizer is refused, even with
    # --allow-change data, and the store keeps its commit
    wide = small_config(steps=1, model_overrides={"n_layers": 2, "vocab_size": 320})
    cfg.write_text(json.dumps(wide.to_dict()))
    store = tmp_path / "s"
    assert _run(capsys, "train", "--config", cfg, "--store", store, "--data", tmp_path / "a.bin")[0] == 0
    wide.steps = 2
    cfg.write_text(json.dumps(wide.to_dict()))
    for other in ("b.bin", "byte.bin"):
        if other == "byte.bin":
            assert _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / other)[0] == 0
        code, _, err = _run(capsys, "train", "--config", cfg, "--store", store, "--data", tmp_path / other,
                            "--allow-change", "steps,data")
        assert code == 2 and len(err) == 1 and "was tokenized by" in err[0] and "tok_a" in err[0], err
    with TensorStore.open(store, read_only=True) as st:
        assert st.last_commit().step == 1
    # the same tokenizer's data passes
    assert _run(capsys, "train", "--config", cfg, "--store", store, "--data", tmp_path / "a.bin",
                "--allow-change", "steps")[0] == 0

    # a store holding RUN/tokenizer/ (as `mtc import` writes it) takes only data from that tokenizer
    (store / "tokenizer").mkdir()
    (store / "tokenizer" / "tokenizer.json").write_bytes((tok_b / "tokenizer.json").read_bytes())
    wide.steps = 3
    cfg.write_text(json.dumps(wide.to_dict()))
    code, _, err = _run(capsys, "train", "--config", cfg, "--store", store, "--data", tmp_path / "a.bin", "--allow-change", "steps")
    assert code == 2 and len(err) == 1 and "not by the run's tokenizer" in err[0], err


def test_prepare_names_a_bad_record_and_skips_and_counts_them_when_asked(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "one"}\n{"text": null}\n{"text": ""}\n{"text": "two"}\n')
    code, _, err = _run(capsys, "prepare", src, "-o", tmp_path / "a.bin")
    assert code == 2 and len(err) == 1 and "a.jsonl:2: field 'text' is null" in err[0] and "--skip-bad-records" in err[0]
    code, out, err = _run(capsys, "prepare", src, "-o", tmp_path / "a.bin", "--skip-bad-records")
    assert code == 0 and "2 documents" in out, out
    assert err == ["note: 1 of the 3 documents read had no text (no tokens): left out",
                   "note: skipped 1 bad records (--skip-bad-records); they were:",
                   f"  {src}:2: field 'text' is null, not text"], err



def test_prepare_says_a_json_array_is_not_jsonl(tmp_path, capsys):
    # a .json file holding one array of records once read "has no field 'text' (it has: list)"
    recs = [{"text": "one"}, {"text": "two"}]
    (tmp_path / "line.json").write_text(json.dumps(recs) + "\n")
    (tmp_path / "pretty.json").write_text(json.dumps(recs, indent=1) + "\n")
    for name, says in (("line.json", "line.json:1 holds a JSON array, not an object; "),
                       ("pretty.json", "pretty.json:1 opens a JSON array, not an object; ")):
        code, _, err = _run(capsys, "prepare", tmp_path / name, "-o", tmp_path / "o.bin")
        assert code == 2 and len(err) == 1 and says in err[0], err
        assert "reads JSONL, one JSON object per line" in err[0] and "jq -c '.[]'" in err[0], err
    (tmp_path / "s.jsonl").write_text('{"text": "one"}\n"two"\n')
    code, _, err = _run(capsys, "prepare", tmp_path / "s.jsonl", "-o", tmp_path / "o.bin")
    assert code == 2 and "s.jsonl:2 holds a JSON string, not an object; each line of a JSONL file holds one JSON object" in err[0]
    assert not list(tmp_path.glob("o.*"))  # nothing written

def test_export_and_generate_refuse_a_tokenizer_beside_the_data_that_was_replaced(tmp_path, capsys):
    """They fall back on the ``<data>.tokenizer/`` directory the data was prepared with; preparing the
    data again with another tokenizer replaces it, and its files would turn the run's ids into other
    text: refused by its sha256 against the run's record, with --tokenizer as the way out (export
    copied the new files, generate decoded with them)."""
    (tmp_path / "a.txt").write_text("\n".join(SENTENCES * 3))
    tok_a, tok_b = bpe_dir(tmp_path, name="tok_a"), bpe_dir(tmp_path, vocab_size=290, name="tok_b")
    assert _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / "a.bin", "--tokenizer", tok_a)[0] == 0
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=1, model_overrides={"n_layers": 2, "vocab_size": 320}).to_dict()))
    store = tmp_path / "s"
    assert _run(capsys, "train", "--config", cfg, "--store", store, "--data", tmp_path / "a.bin")[0] == 0
    generate = ("generate", store, "--prompt", "the", "--max-new-tokens", "2")
    assert _run(capsys, *generate)[0] == 0
    assert _run(capsys, "prepare", tmp_path / "a.txt", "-o", tmp_path / "a.bin", "--tokenizer", tok_b)[0] == 0
    for argv in (("export", store, "-o", tmp_path / "x"), generate):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and len(err) == 1 and "is not the one that data was made by" in err[0] and "--tokenizer" in err[0], err
    assert not (tmp_path / "x").exists()
    # told which: the run's own
    assert _run(capsys, "export", store, "-o", tmp_path / "x", "--tokenizer", tok_a)[0] == 0
    assert (tmp_path / "x" / "tokenizer.json").read_bytes() == (tok_a / "tokenizer.json").read_bytes()
    assert _run(capsys, *generate, "--tokenizer", tok_a)[0] == 0
