"""A run you can watch: --eval-every, mtc eval, mtc generate (streamed, KV cache), metrics, progress, plot, TensorBoard."""

from __future__ import annotations

import io
import json
import sys
import time

import pytest
import torch
from mtc.store import TensorStore

from mtc.cli import main
from mtc.config import TrainConfig
from mtc.data import ByteTokenizer
from mtc.errors import ConfigError
from mtc.evaluate import evaluate_store
from mtc.generate import generate, generate_from_store
from mtc.metrics import FlopCounter, model_flops, peak_rate
from mtc.plan import load_plan
from mtc.progress import ProgressBar
from mtc.runtime.state import load_into_module
from mtc.train import build_model
from tests.runtime.engine_util import skewed_tokens, small_config


def _metrics(store) -> list[dict]:
    return [json.loads(ln) for ln in (store / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 5-step run (commits at 2, 4 and 5) with the validation loss every 2 steps and at the end."""
    root = tmp_path_factory.mktemp("watch")
    tokens = skewed_tokens(root / "tok.bin")
    cfg = root / "run.json"
    cfg.write_text(json.dumps(small_config(steps=5, commit_every=2, eval_every=2, eval_batches=2).to_dict()))
    store = root / "s"
    assert main(["train", "--config", str(cfg), "--store", str(store), "--data", str(tokens.path)]) == 0
    return store, tokens.path


def test_eval_every_logs_the_val_loss_of_each_steps_weights(run):
    store, data = run
    recs = _metrics(store)
    assert [r["step"] for r in recs if r["val_loss"] is not None] == [2, 4, 5]
    val = {r["step"]: r["val_loss"] for r in recs}
    # an independent eval of the committed weights (read back from the store) gives the same number:
    # the in-run eval waited for the step's updates and read nothing older or newer
    for step in (5, 4):
        res = evaluate_store(store, data, step=step, batches=2)
        assert res.step == step and res.loss == pytest.approx(val[step], rel=1e-6, abs=1e-7)
    assert val[4] != val[5]


def test_mtc_eval_defaults_to_the_runs_eval_batches(run, capsys):
    # the run validated on 2 batches: `mtc eval` with no --batches must average the same ones
    store, data = run
    val = {r["step"]: r["val_loss"] for r in _metrics(store)}
    capsys.readouterr()
    assert main(["eval", str(store), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "(2 batches" in out, out
    assert float(out.split(" loss ")[1].split()[0]) == pytest.approx(val[5], abs=2e-6)
    assert evaluate_store(store, data).loss == pytest.approx(val[5], rel=1e-6, abs=1e-7)


def test_eval_every_on_disk_layers_reads_the_updated_weights(tmp_path):
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = small_config(steps=3, eval_every=1, eval_batches=1, placement="ram:0-1,disk:2-3", grad_accum=1)
    from mtc.train import train

    res = train(cfg, tmp_path / "s", tokens)
    res.store.close()
    val = [r.val_loss for r in res.records]
    assert len(set(val)) == 3
    assert evaluate_store(tmp_path / "s", tokens.path, batches=1).loss == pytest.approx(val[-1], rel=1e-6)


def test_eval_runs_in_the_plans_dtype(tmp_path):
    # the plan's templates take weights in the dtype they were traced in: a bf16 run evaluated on the
    # CPU (where eval once chose fp32 for a bf16 config) failed in its first matmul
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = small_config(steps=2, eval_every=2, eval_batches=1, compute_dtype="bfloat16", grad_accum=1)
    from mtc.train import train

    res = train(cfg, tmp_path / "s", tokens)
    res.store.close()
    assert evaluate_store(tmp_path / "s", tokens.path, batches=1).loss == pytest.approx(res.records[-1].val_loss, rel=1e-3)


def test_cli_eval_is_repeatable_and_names_the_available_steps(run, capsys):
    store, data = run
    outs = []
    for _ in range(2):
        assert main(["eval", str(store), "--data", str(data), "--batches", "2"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1].replace(outs[1].split("tokens, ")[1], outs[0].split("tokens, ")[1])  # timings aside
    assert outs[0].startswith("step 5: val loss ") and "perplexity" in outs[0]
    assert main(["eval", str(store), "--data", str(data), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mtc: error: step 3 is not in store")
    assert "5 (last commit), 4 (previous commit)" in err


def test_cli_eval_all_split_differs_and_bad_data_is_one_line(run, tmp_path, capsys):
    store, data = run
    assert main(["eval", str(store), "--data", str(data), "--batches", "2", "--split", "all"]) == 0
    assert "all loss" in capsys.readouterr().out
    assert main(["eval", str(store), "--data", str(tmp_path / "nope.bin")]) == 2
    assert capsys.readouterr().err.startswith("mtc: error: ")


def test_metrics_fields_are_present_and_sane(run):
    store, _ = run
    recs = _metrics(store)
    cfg = small_config(steps=5, commit_every=2, eval_every=2, eval_batches=2)
    counter = FlopCounter.of(load_plan(store / "plan"), cfg.seq_len)
    for r in recs:
        assert r["tokens"] == cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["tflops"] == pytest.approx(counter.flops(r["tokens"]) / r["seconds"] / 1e12)
        assert r["host_rss_bytes"] > 50 * 2**20
        assert r["gpu_peak_bytes"] is None  # the CPU
        assert (r["mfu"] is None) == (r["peak_tflops"] is None)
        if r["mfu"] is not None:  # a machine profile of this CPU exists
            assert r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops"])
        assert r["phase_s"]["compute"] > 0 and all(v >= 0 for v in r["phase_s"].values())
        assert sum(r["phase_s"].values()) < 8 * r["seconds"]  # spans clipped to the step (a few threads at most)
    resolved = json.loads((store / "logs" / "config-step0.json").read_text())
    assert resolved["mfu_denominator"].startswith(("n/a", "calibrated"))


def test_model_flops_formula_and_counter():
    cfg = small_config()
    program = load_plan_of(cfg)
    c = FlopCounter.of(program, cfg.seq_len)
    m = build_model(cfg)
    total = sum(p.numel() for p in m.parameters())
    assert c.n_params == total - m.embed.weight.numel()  # an untied embedding is a lookup
    assert (c.n_blocks, c.attention_width) == (2, 2 * 128)  # two blocks, each one attention of 128 = heads x head size
    assert model_flops(10, n_params=100, attention_width=16, seq_len=16) == 10 * (600 + 12 * 16 * 16)
    tied = small_config(model="gpt2-tiny", model_overrides={})
    ct = FlopCounter.of(load_plan_of(tied), tied.seq_len)
    mt = build_model(tied)
    assert ct.n_params == sum(p.numel() for p in mt.parameters()) - mt.wpe.weight.numel()  # wte is the head too


def load_plan_of(cfg: TrainConfig):
    from mtc.tracer import trace

    return trace(build_model(cfg), cfg.micro_batch_size, cfg.seq_len)


def test_peak_rate_sources(tmp_path, monkeypatch):
    none = tmp_path / "none.json"
    assert peak_rate("cpu", "float32", profile=none).tflops is None
    assert peak_rate("cpu", "float32", profile=none).source.startswith("n/a")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_rate("cuda", "bfloat16", profile=none).tflops == 989.4
    assert peak_rate("cuda", "float32", profile=none).tflops == 494.7  # TF32
    assert peak_rate("cuda", "float32", allow_tf32=False, profile=none).tflops == 66.9
    prof = tmp_path / "machine.json"
    prof.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "matmul_dtype": "bfloat16",
                                "matmul": [{"tflops": 700.0}, {"tflops": 780.0}, {"tflops": 240.0}, {"tflops": 800.0}]}))
    p = peak_rate("cuda", "bfloat16", profile=prof)
    # the fastest shape: thin ones are timed on purpose and far below the peak (the median gave MFU > 1)
    assert p.tflops == 800.0 and p.source.startswith("calibrated") and p.mfu(400.0) == 0.5
    assert peak_rate("cuda", "float32", allow_tf32=False, profile=prof).tflops == 66.9  # other dtype: datasheet
    for name, bf16 in (("NVIDIA H200 NVL", 835.5), ("NVIDIA H200", 989.4), ("NVIDIA H100 PCIe", 756.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert peak_rate("cuda", "bfloat16", profile=none).tflops == bf16, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some GPU")
    assert peak_rate("cuda", "bfloat16", profile=none).tflops is None


@pytest.fixture(scope="module", params=["tiny", "gpt2-tiny"])
def gen_run(request, tmp_path_factory):
    """A 2-step run with a wide init, so greedy decoding does not collapse to one repeated token."""
    root = tmp_path_factory.mktemp("gen")
    tokens = skewed_tokens(root / "tok.bin")
    overrides = {"n_layers": 2, "init_std": 0.5}
    cfg = small_config(model=request.param, model_overrides=overrides, steps=2, seq_len=32)
    from mtc.train import train

    res = train(cfg, root / "s", tokens)
    res.store.close()
    return root / "s", cfg


def test_generate_with_kv_cache_equals_without_and_the_resident_model(gen_run):
    store, cfg = gen_run
    prompt = "The sea at"
    cached = generate_from_store(store, prompt, max_new_tokens=12, temperature=0)
    streamed = generate_from_store(store, prompt, max_new_tokens=12, temperature=0, kv_cache=False, device_budget_bytes=0)
    assert cached.tokens == streamed.tokens and len(set(cached.tokens)) > 3
    assert (cached.resident_layers, cached.streamed_layers) == (4, 0)
    assert (streamed.resident_layers, streamed.streamed_layers) == (0, 4)
    assert cached.step == 2 and cached.tokens_per_s > 0 and cached.text == ByteTokenizer().decode(cached.tokens)
    # the plain forward of the whole model, loaded from the store, picks the same tokens
    with TensorStore.open(store, read_only=True) as st:
        model = build_model(cfg)
        load_into_module(model, load_plan(store / "plan"), st, st.last_commit().generation)
    ref = generate(model, list(ByteTokenizer().encode(prompt)), max_new_tokens=12, context=32, temperature=0)
    assert ref == cached.tokens
    # sampling: the same seed gives the same text with and without the cache
    a = generate_from_store(store, prompt, max_new_tokens=8, temperature=0.9, top_k=20, seed=7)
    b = generate_from_store(store, prompt, max_new_tokens=8, temperature=0.9, top_k=20, seed=7, kv_cache=False)
    assert a.tokens == b.tokens


def test_generate_past_the_window_refills_the_cache_with_and_without_it_alike(gen_run):
    store, cfg = gen_run
    r = generate_from_store(store, "abc", max_new_tokens=20, temperature=0, context=12)
    assert len(r.tokens) == 20 and r.context == 12 and r.prompt_dropped == 0
    # the uncached path checks the cached one: the same windows, so the same tokens; so does the
    # resident model's plain forward
    assert generate_from_store(store, "abc", max_new_tokens=20, temperature=0, context=12, kv_cache=False).tokens == r.tokens
    with TensorStore.open(store, read_only=True) as st:
        model = build_model(cfg)
        load_into_module(model, load_plan(store / "plan"), st, st.last_commit().generation)
    assert generate(model, list(ByteTokenizer().encode("abc")), max_new_tokens=20, context=12, temperature=0) == r.tokens
    long = generate_from_store(store, "a longer prompt than that", max_new_tokens=3, temperature=0, context=12)
    assert long.prompt_dropped == len("a longer prompt than that") - 12
    # no context named: the whole prompt and continuation (no window), up to the model's max_seq_len
    assert generate_from_store(store, "abc", max_new_tokens=40, temperature=0).context == 43


def test_generate_stops_at_the_eos_ids_an_imported_checkpoint_names(gen_run, tmp_path):
    import shutil

    store, _ = gen_run
    first = generate_from_store(store, "The sea at", max_new_tokens=6, temperature=0).tokens
    copy = tmp_path / "run"
    shutil.copytree(store, copy)
    (copy / "hf").mkdir()
    (copy / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [255, first[2]]}))
    r = generate_from_store(copy, "The sea at", max_new_tokens=6, temperature=0)
    assert r.tokens == first[: first.index(first[2])] and r.stopped_at_eos


def test_cli_generate_prints_text_and_speed_and_refuses_a_missing_step(gen_run, capsys):
    store, _ = gen_run
    assert main(["generate", str(store), "--prompt", "Once", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Once") and "tokens/s" in err and "KV cache on" in err
    assert main(["generate", str(store), "--prompt", "Once", "--step", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step 7 is not in store" in err and "2 (last commit)" in err
    assert main(["generate", str(store), "--prompt", "Once", "--context", "1000"]) == 2
    assert "max_seq_len" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--context", "0"], "--context must be >= 1"),  # (0 was taken as the default window)
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),  # (torch's multinomial raised)
    (["--weights-budget-gb", "-1"], "--weights-budget-gb must be a finite number of GB >= 0"),
    (["--weights-budget-gb", "nan"], "--weights-budget-gb must be a finite number of GB >= 0"),  # (int() raised ValueError)
    (["--weights-budget-gb", "inf"], "--weights-budget-gb must be a finite number of GB >= 0"),  # (and OverflowError)
    (["--seed", str(2**64)], f"--seed must be an integer from 0 to {2**64 - 1}, got {2**64}"),  # (torch's "Overflow when unpacking")
    (["--seed", "-1"], f"--seed must be an integer from 0 to {2**64 - 1}, got -1"),
    (["--device", "foo"], "a device is 'cpu', 'cuda' or 'cuda:N'"),  # (torch's RuntimeError)
])
def test_cli_generate_refuses_settings_that_mean_nothing_in_one_line(gen_run, capsys, flags, says):
    store, _ = gen_run
    assert main(["generate", str(store), "--prompt", "Once", "--max-new-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_eval_and_generate_on_a_missing_cuda_device_are_one_line(run, gen_run, capsys):
    store, data = run
    assert main(["eval", str(store), "--data", str(data), "--device", "cuda"]) == 2
    assert main(["generate", str(gen_run[0]), "--prompt", "Once", "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("this machine has no CUDA device" in e for e in err), err


def test_plot_writes_a_png(run, tmp_path, capsys):
    store, _ = run
    out = tmp_path / "run.png"
    assert main(["plot", str(store), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # a suffix names the format (a .pdf held PNG bytes); one matplotlib cannot write gives a PNG
    for name, magic in (("run.pdf", b"%PDF"), ("run.svg", b"<?xml"), ("run.plot", b"\x89PNG")):
        assert main(["plot", str(store), "-o", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_tensorboard_sink_writes_events_or_says_how_to_install(run, tmp_path, monkeypatch, capsys):
    _, data = run
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=2).to_dict()))
    args = ["train", "--config", str(cfg), "--store", str(tmp_path / "s"), "--data", str(data), "--tensorboard", str(tmp_path / "tb")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        assert main(args) == 0
        events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0
        capsys.readouterr()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    from mtc.tensorboard import TensorBoardSink

    with pytest.raises(ConfigError, match="pip install tensorboard"):
        TensorBoardSink(tmp_path / "tb2")
    assert main([*args[:4], str(tmp_path / "s2"), *args[5:]]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "mtc: error: --tensorboard needs the tensorboard package: pip install tensorboard"
    assert not (tmp_path / "s2" / "commit.json").exists()


def test_a_tensorboard_path_that_is_a_file_is_refused_before_the_store_is_made(run, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    _, data = run
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=2).to_dict()))
    (tmp_path / "afile").write_text("x")
    for tb, says in (("afile", "it is a file, not a directory"), ("afile/tb", f"{tmp_path / 'afile'}, a parent of it, is a file")):
        store = tmp_path / "s"
        code = main(["train", "--config", str(cfg), "--store", str(store), "--data", str(data),
                     "--tensorboard", str(tmp_path / tb)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err  # (a FileExistsError traceback, after the store was made)
        assert err.startswith(f"mtc: error: --tensorboard {tmp_path / tb}: {says}"), err
        assert not store.exists()
    assert (tmp_path / "afile").read_text() == "x"


def test_progress_bar_lines_off_a_terminal_and_tqdm_on_one():
    buf = io.StringIO()
    bar = ProgressBar(40, initial=0, stream=buf)
    for s in range(1, 41):
        bar.update(s, loss=2.0, **{"tok/s": 1000.0, "TFLOP/s": 0.5, "MFU": "n/a"})
    bar.close()
    lines = buf.getvalue().splitlines()
    assert 15 <= len(lines) <= 22 and "\r" not in buf.getvalue()
    assert all("loss=2" in ln and "tok/s=1000" in ln and "MFU=n/a" in ln for ln in lines)
    assert lines[-1].startswith("train: 100%") and "40/40" in lines[-1]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = ProgressBar(5, initial=2, stream=tty)
    for s in range(3, 6):
        bar.update(s, loss=1.5)
    bar.close()
    bar.close()
    text = tty.getvalue()
    assert "\r" in text and "5/5" in text and text.endswith("\n") and text.count("\n") == 1


@pytest.mark.parametrize("scaling", ["linear", "llama3"])
def test_the_decoder_rotates_as_the_model_trained_with_rope_scaling(scaling):
    # generation ran blocks with unscaled RoPE tables: a rope-scaled import (Llama 3.1/3.2) decoded
    # other logits than the model it trained
    from mtc.decoders import Decoder
    from mtc.models import build

    torch.manual_seed(0)
    model = build("tiny", rope_scaling=scaling, rope_factor=4.0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 48))
    dec = Decoder(model)
    w = dict(model.named_parameters())
    x = dec.embed(w, ids, 0)
    for j in range(dec.n_blocks):
        x = dec.block(j, w, x, 0)
    torch.testing.assert_close(dec.head(w, x), model(ids).float(), atol=1e-5, rtol=1e-5)


def test_a_step_overwritten_while_it_is_read_is_never_reported(run, tmp_path, monkeypatch):
    """Beside a running trainer: when training starts writing a later step into the generation
    being read (the write log says so before any write), eval, generation and load_state_dict
    refuse the mixed weights instead of reporting a number for the wrong step; evaluating the newest
    commit (no step named) just reads again."""
    import shutil

    import mtc.evaluate
    from mtc.generate import generate_from_store
    from mtc.warmstart import load_state_dict
    from mtc.weight_sources import StoreWeights, WeightsOverwritten, record_write_start
    from mtc.shards import StateReader

    store, data = run
    copy = tmp_path / "s"
    shutil.copytree(store, copy)
    with TensorStore.open(copy, read_only=True) as st:
        gen4 = next(r.generation for r in st.commit_history() if r.step == 4)
    clean = (copy / "logs" / "writes.jsonl").read_text()

    def overwrite_during(cls, name):
        orig = getattr(cls, name)

        def reading(self, *a, **k):
            out = orig(self, *a, **k)
            record_write_start(copy, 6, gen4)  # training moved on: step 6 into step 4's generation
            return out

        monkeypatch.setattr(cls, name, reading)

    overwrite_during(StoreWeights, "_load_host")
    with pytest.raises(WeightsOverwritten, match="training began writing a later step into state generation"):
        evaluate_store(copy, data, step=4, batches=1)
    (copy / "logs" / "writes.jsonl").write_text(clean)
    with pytest.raises(WeightsOverwritten, match="sampling from step 4"):
        generate_from_store(copy, "The sea", step=4, max_new_tokens=2, temperature=0)
    (copy / "logs" / "writes.jsonl").write_text(clean)
    overwrite_during(StateReader, "read")
    with pytest.raises(WeightsOverwritten, match="load_state_dict of step 4"):
        load_state_dict(copy, step=4)
    monkeypatch.undo()
    (copy / "logs" / "writes.jsonl").write_text(clean)
    assert evaluate_store(copy, data, step=4, batches=2).loss == pytest.approx(evaluate_store(store, data, step=4, batches=2).loss)
    # the newest commit: a read that raced a write is simply made again
    calls, check = [], mtc.evaluate.check_untouched

    def racing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise WeightsOverwritten("raced")
        return check(*a, **k)

    monkeypatch.setattr(mtc.evaluate, "check_untouched", racing_once)
    assert evaluate_store(copy, data, batches=1).step == 5 and len(calls) == 2


def test_tensorboard_events_of_a_resumed_run_replace_the_redone_steps(tmp_path):
    """An interrupted run logged steps 1-5 (records count completed steps) but committed at 2; the
    resumed run starts from step 2 and redoes steps 3-4: the events read back hold each step once,
    the committed step 2 kept, the resumed run's values for 3 and 4."""
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mtc.tensorboard import TensorBoardSink

    first = TensorBoardSink(tmp_path / "tb")
    for s in range(1, 6):
        first.write(SimpleNamespace(step=s, loss=10.0 + s))
    first.close()
    resumed = TensorBoardSink(tmp_path / "tb", start_step=2)
    for s in (3, 4):
        resumed.write(SimpleNamespace(step=s, loss=20.0 + s))
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]


def test_a_plain_copy_of_a_store_keeps_its_previous_commit(run, tmp_path):
    """`cp -r` (new file times) of a run: the previous commit is still readable (load_state_dict,
    export's step choice) and repair can still roll back to it: the write log, not file times, says
    that its generation was not written since."""
    import shutil

    from mtc.store import repair, state_array_name
    from mtc.warmstart import available_steps, load_state_dict

    store, _ = run
    copy = tmp_path / "copy"
    time.sleep(0.05)
    shutil.copytree(store, copy, copy_function=shutil.copy)  # contents only: every file time is now
    with TensorStore.open(copy, read_only=True) as st:
        assert sorted(available_steps(st)) == [4, 5]
        gen5 = st.last_commit().generation
    old = load_state_dict(store, step=4)
    new = load_state_dict(copy, step=4)
    assert all(torch.equal(old[k], new[k]) for k in old)
    with TensorStore.open(copy) as st:
        chunk = st.chunk_path(state_array_name(1, "master", gen5), 0)
        raw = bytearray(chunk.read_bytes())
        raw[5] ^= 0x40
        chunk.write_bytes(bytes(raw))
        done = repair(st)
        assert done.restored.step == 4, done.actions


def test_generation_stops_at_eos_end_of_turn_markers_and_stop_tokens(gen_run, tmp_path):
    """A chat-tuned model ends its reply with its template's end-of-turn token, which need not be
    the tokenizer's EOS: both stop sampling, as does a token named with --stop (not kept)."""
    from mtc.data import get_tokenizer
    from mtc.errors import ConfigError
    from mtc.generate import stop_ids
    from tests.data.tok_util import bpe_dir

    chatml = get_tokenizer(str(bpe_dir(tmp_path)))
    assert stop_ids(chatml) == {chatml.eos_id, int(chatml.encode("<|im_end|>", special=False)[0])}
    assert stop_ids(ByteTokenizer()) == frozenset()  # the byte tokenizer has neither
    with pytest.raises(ConfigError, match=r"--stop 'ab' is 2 tokens of the run's tokenizer, not one"):
        stop_ids(ByteTokenizer(), ["ab"])
    store, _ = gen_run
    free = generate_from_store(store, "The sea at", max_new_tokens=12, temperature=0)
    k = next(i for i, t in enumerate(free.tokens) if t < 128)  # the first token that is a character on its own
    cut = generate_from_store(store, "The sea at", max_new_tokens=12, temperature=0, stop=[chr(free.tokens[k])])
    assert cut.tokens == free.tokens[:k] and cut.stopped_at_eos and not free.stopped_at_eos


def test_metrics_count_the_steps_loss_targets_beside_its_positions(tmp_path):
    """`tokens` counts the positions a step computed (padding and masked prompts included, as
    throughput is quoted); `targets` counts those the loss learned from, the whole global step's."""
    from mtc.data import BatchSampler, prepare
    from mtc.train import train

    rows = [{"q": "question number %d, a long prompt " % i * 2, "a": "answer %d" % i} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tf = prepare(tmp_path / "sft.jsonl", tmp_path / "sft.bin", prompt_field="q", response_field="a")
    cfg = small_config(steps=3, grad_accum=2, seq_len=32)
    res = train(cfg, tmp_path / "s", tf)
    res.store.close()
    s = BatchSampler(tf, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    want = [sum(int((s.batch(k)[1] != -100).sum()) for k in range(2 * i, 2 * i + 2)) for i in range(3)]
    recs = _metrics(tmp_path / "s")
    assert [r["targets"] for r in recs] == [r.targets for r in res.records] == want
    assert all(r["tokens"] == 2 * cfg.micro_batch_size * 32 > r["targets"] > 0 for r in recs), recs


def test_logs_torn_by_a_crash_do_not_swallow_the_next_record(tmp_path):
    """A kill -9 mid-append leaves a torn last line; the next record must start a line of its own
    (the write log decides whether eval may trust a generation: a lost record there is a wrong loss)."""
    from mtc.store.directory import read_write_starts, record_write_start
    from mtc.train import _open_metrics

    logs = tmp_path / "logs"
    logs.mkdir()
    record_write_start(tmp_path, 3, 1)
    with open(logs / "writes.jsonl", "a") as f:
        f.write('{"step": 5, "gener')  # torn
    record_write_start(tmp_path, 6, 0)
    assert [(r["step"], r["generation"]) for r in read_write_starts(tmp_path)] == [(3, 1), (6, 0)]
    # metrics: the torn line is cut off (its step is redone and logged again)
    (logs / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    with _open_metrics(logs / "metrics.jsonl") as f:
        f.write('{"step": 2}\n')
    assert (logs / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    (logs / "metrics.jsonl").write_text('{"st')
    with _open_metrics(logs / "metrics.jsonl") as f:
        f.write('{"step": 1}\n')
    assert (logs / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_full_disk_while_logging_a_step_stops_in_one_line_with_the_commit_intact(tmp_path, monkeypatch):
    import errno

    import importlib

    from mtc.errors import StoreError

    train_mod = importlib.import_module("mtc.train")  # (the module: mtc.train is also the API function)

    tokens = skewed_tokens(tmp_path / "tok.bin")

    class Full(io.StringIO):
        name = str(tmp_path / "s" / "logs" / "metrics.jsonl")

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_mod, "_open_metrics", lambda path: Full())
    with pytest.raises(StoreError, match=r"writing .*metrics.jsonl failed after step 1 \(no space left on device\); the "
                       r"store's last commit is intact"):
        train_mod.train(small_config(steps=3, commit_every=1), tmp_path / "s", tokens)
    with TensorStore.open(tmp_path / "s", read_only=True) as st:
        assert st.last_commit().step in (0, 1)  # step 1's commit may or may not have landed; nothing torn
    assert main(["verify", str(tmp_path / "s")]) == 0
    monkeypatch.undo()
    res = train_mod.train(small_config(steps=3, commit_every=1), tmp_path / "s", tokens)  # resumes
    res.store.close()
    assert res.end_step == 3


def test_attention_flops_count_each_attentions_own_width():
    """Heads wider than the hidden state (as Qwen3's), and a block without attention: the attention
    term sums what each attention computes, not blocks x hidden width."""
    import torch.nn.functional as F
    from torch import nn

    from mtc.tracer import trace

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, attend: bool) -> None:
            super().__init__()
            self.heads, self.attend = heads, attend
            self.qkv = nn.Linear(d, 3 * heads * 8) if attend else None
            self.proj = nn.Linear(heads * 8, d) if attend else nn.Linear(d, d)

        def forward(self, x):
            if not self.attend:
                return x + self.proj(x)
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, self.heads, 8).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
            return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList([Block(16, 4, True), Block(16, 4, False), Block(16, 2, True)])
            self.head = nn.Linear(16, 64)

        def forward(self, ids):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

    c = FlopCounter.of(trace(Model(), 2, 8), 8)
    assert (c.n_blocks, c.attention_width) == (3, 4 * 8 + 2 * 8)


def test_readers_of_a_run_trained_with_durability_none_say_it_kept_no_weights(tmp_path, capsys):
    """A finished --durability none run commits nothing; its store keeps the set-up marker, and the
    readers said the set-up had stopped and the same command would start the store over."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=1, durability="none").to_dict()))
    store = tmp_path / "s"
    assert main(["train", "--config", str(cfg), "--store", str(store), "--data", str(tokens.path)]) == 0
    capsys.readouterr()
    for argv in (["eval", str(store), "--data", str(tokens.path)], ["generate", str(store), "--prompt", "a"],
                 ["inspect", str(store)], ["export", str(store), "-o", str(tmp_path / "hf")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "trained with durability 'none', which commits nothing" in err, (argv, err)
    import mtc

    with pytest.raises(mtc.errors.StoreError, match="--durability weights"):
        mtc.load_state_dict(store)
