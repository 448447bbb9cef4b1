"""The typed config schema: every bad value is one ConfigError naming the field and the value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mtc.cli import _train_config, build_parser, main
from mtc.config import OptimConfig, TrainConfig, auto_device, check_device, load_config, parse_layer_set, parse_placement
from mtc.errors import ConfigError
from mtc.models import preset_names

# (TOML text, field named in the message, value as the message shows it)
BAD_TOML = [
    ('[optim]\nlr = "abc"', "optim.lr", "'abc' (str)"),
    ('steps = "3"', "steps", "'3' (str)"),
    ("steps = 2.5", "steps", "2.5 (float)"),
    ("micro_batch_size = true", "micro_batch_size", "True (bool)"),
    ('[model_overrides]\nn_layers = "2"', "model_overrides.n_layers", "'2' (str)"),
    ("[model_overrides]\nn_heads = 0", "model_overrides.n_heads", "0 (int)"),
    ("[model_overrides]\nnope = 1", "model_overrides.nope", "'nope'"),
    ("[optim]\nlr = inf", "optim.lr", "inf (float)"),
    ("[optim]\nclip_norm = nan", "optim.clip_norm", "nan (float)"),
    ("[optim]\nbeta2 = 1.0", "optim.beta2", "1.0 (float)"),
    ("[optim]\nmin_lr = 0.1", "optim.min_lr", "0.1"),
    ("[optim]\nwarmup_steps = -1", "optim.warmup_steps", "-1 (int)"),
    ("seed = -1", "seed", "-1 (int)"),
    ("seed = 18446744073709551616", "seed", "expected an integer >= 0 and <= 18446744073709551615, got 18446744073709551616 (int)"),
    ("[optim]\nlr = 1e39", "optim.lr", "expected a finite number > 0 and <= 3.40282e+38, got 1e+39 (float)"),
    ("[optim]\nweight_decay = 1e39", "optim.weight_decay", "1e+39 (float)"),
    ("ram_budget_gb = 0", "ram_budget_gb", "0.0 (float)"),
    ("gpu_budget_gb = -inf", "gpu_budget_gb", "-inf (float)"),
    ("commit_every = -1", "commit_every", "-1 (int)"),
    ("optim_threads = -1", "optim_threads", "-1 (int)"),
    ("io_threads = 0", "io_threads", "0 (int)"),
    ("max_nonfinite_steps = 0", "max_nonfinite_steps", "0 (int)"),
    ('compute_dtype = "fp16"', "compute_dtype", "'fp16' (str)"),
    ('durability = "some"', "durability", "'some' (str)"),
    ('device = "gpu"', "device", "'gpu' (str)"),
    ("allow_tf32 = 1", "allow_tf32", "1 (int)"),
    ('placement = "gpu:0-3,ram:3-4"', "placement", "'gpu:0-3,ram:3-4' (str)"),
    ('placement = "fast:0-3"', "placement", "'fast:0-3' (str)"),
    ('placement = "gpu:3-1"', "placement", "'gpu:3-1' (str)"),
    ('gpu_update = "0-x"', "gpu_update", "'0-x' (str)"),
    ("seq_len = 1000", "seq_len", "1000"),
    ('model = "nosuch"', "model", "'nosuch'"),
    ("optim = 3", "optim", "3 (int)"),
]


@pytest.mark.parametrize(("toml", "field", "shown"), BAD_TOML, ids=[b[0] for b in BAD_TOML])
def test_bad_toml_value_names_field_and_value(tmp_path, toml, field, shown):
    (tmp_path / "c.toml").write_text(toml + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.toml")
    msg = str(e.value)
    assert f"config field {field}" in msg and shown in msg and "\n" not in msg, msg


def test_unknown_key_lists_known_ones():
    with pytest.raises(ConfigError, match=r"optim\.lrr; known: .*lr"):
        TrainConfig.from_dict({"optim": {"lrr": 1.0}})


def test_float_field_takes_int_and_none_where_optional(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"optim": {"lr": 1, "min_lr": 0, "clip_norm": None}, "ram_budget_gb": 8}))
    cfg = load_config(tmp_path / "c.json")
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float and cfg.optim.clip_norm is None
    assert type(cfg.ram_budget_gb) is float


@pytest.mark.parametrize("cfg", [
    TrainConfig(),
    TrainConfig(steps=7, model="gpt2-tiny", model_overrides={"n_layers": 2, "norm_eps": 1e-6}, device="cuda:1",
                placement="gpu:0-1,ram:2-3,disk:4", gpu_update="0-1,4", durability="weights", commit_every=5,
                ram_budget_gb=12.5, max_nonfinite_steps=1, allow_tf32=False, optim=OptimConfig(clip_norm=None, lr=1e-3)),
    TrainConfig(placement="stateless", gpu_update="none", compute_dtype="bfloat16", kernels="unfused"),
], ids=["default", "everything", "words"])
def test_valid_configs_round_trip(tmp_path, cfg):
    cfg.validate()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    assert load_config(tmp_path / "c.json") == cfg


def test_parse_placement():
    assert parse_placement("gpu:0-1,ram:2-3,disk:4", 5) == ["gpu", "gpu", "ram", "ram", "disk"]
    assert parse_placement("ram:2-3, gpu:0-1 ,ram:4", 5) == ["gpu", "gpu", "ram", "ram", "ram"]
    assert parse_placement("stateless", 3) == ["stateless"] * 3 and parse_placement("auto", 2) == ["auto"] * 2
    with pytest.raises(ConfigError, match=r"layers 2-3, 6 have no tier.*'gpu:0-1,ram:4-5'"):
        parse_placement("gpu:0-1,ram:4-5", 7)
    with pytest.raises(ConfigError, match=r"layer 9 is beyond the model's last layer 5"):
        parse_placement("gpu:0-1,ram:2-9", 6)
    with pytest.raises(ConfigError, match=r"layer 3 is in both gpu:0-3 and ram:3-5"):
        parse_placement("gpu:0-3,ram:3-5", 6)
    with pytest.raises(ConfigError, match=r"config field placement: .*got 'gpu,ram' \(str\); 'gpu' is not tier:ranges"):
        parse_placement("gpu,ram", 6)


def test_parse_layer_set():
    assert parse_layer_set("auto", 4) is None
    assert parse_layer_set("none", 4) == set() and parse_layer_set("all", 3) == {0, 1, 2}
    assert parse_layer_set("0-1,3", 4) == {0, 1, 3}
    with pytest.raises(ConfigError, match=r"config field gpu_update: layer 4 is beyond .*got '3-4'"):
        parse_layer_set("3-4", 4)
    with pytest.raises(ConfigError, match=r"gpu_update: .*'some' \(str\)"):
        parse_layer_set("some", 4)


def test_check_device(monkeypatch):
    cfg = TrainConfig(device="cuda")
    cfg.validate()  # a CUDA config is valid on any machine; only check_device asks torch
    check_device(TrainConfig(device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device cuda: this machine has no CUDA device .*use --device cpu$"):
        check_device(cfg)


def _train(tmp_path, *flags):
    return ["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", str(tmp_path / "none.bin"), *flags]


@pytest.mark.parametrize(("flags", "shown"), [
    (["--lr", "inf"], "config field optim.lr (--lr): expected a finite number > 0 and <= 3.40282e+38, got inf (float)"),
    (["--lr", "abc"], "optim.lr (--lr): expected a finite number > 0 and <= 3.40282e+38, got 'abc'"),
    # (these stopped the run inside AdamW, "cannot be converted to type float without overflow",
    # after set-up had written the store; a seed past uint64 in torch.manual_seed, "Overflow when unpacking")
    (["--lr", "1e39"], "optim.lr (--lr): expected a finite number > 0 and <= 3.40282e+38, got 1e+39 (float)"),
    (["--lr", "1e38"], "optim.lr: AdamW's first step size, lr / (1 - beta1) = 1e+39, overflows a float32"),
    (["--min-lr", "1e39"], "optim.min_lr (--min-lr): expected a finite number >= 0 and <= 3.40282e+38, got 1e+39"),
    (["--weight-decay", "1e39"], "optim.weight_decay (--weight-decay): expected a finite number >= 0 and <= 3.40282e+38"),
    (["--lr", "1e37", "--weight-decay", "1e3"], "optim.weight_decay: lr * weight_decay = 1e+40 overflows a float32"),
    (["--seed", str(2**64)], f"seed (--seed): expected an integer >= 0 and <= {2**64 - 1}, got {2**64} (int)"),
    (["--steps", "2.5"], "steps (--steps): expected an integer >= 1, got '2.5'"),
    (["--micro-batch-size", "0"], "micro_batch_size (--micro-batch-size): expected an integer >= 1, got 0"),
    (["--clip-norm", "-1"], "optim.clip_norm (--clip-norm): expected a finite number > 0 or none, got -1.0"),
    (["--ram-budget-gb", "nan"], "ram_budget_gb (--ram-budget-gb): expected a finite number > 0 or none, got nan"),
    (["--stop-after", "0"], "--stop-after: expected a step number >= 1"),
    (["--stop-after", "-3"], "got -3"),
    (["--stop-after", "3", "--durability", "none"], "this run would commit nothing, so the steps it trains would be lost "
                                                     "and a later run would start again from step 0"),
    (["--placement", "gpu:0-3,ram:2-4"], "layer 2 is in both gpu:0-3 and ram:2-4"),
    (["--placement", "gpus"], "placement (--placement): expected one of 'auto', 'gpu'"),
    (["--gpu-update", "1-"], "gpu_update (--gpu-update)"),
    (["--kernels", "fast"], "kernels (--kernels): expected one of 'auto', 'fused', 'unfused', got 'fast'"),
    (["--min-lr", "1"], "optim.min_lr: expected at most optim.lr"),
    (["--seq-len", "4096"], "seq_len: expected at most the max_seq_len 256"),
])
def test_cli_bad_flag_is_one_line_exit_2(tmp_path, capsys, flags, shown):
    assert main(_train(tmp_path, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtc: error: ") and err.count("\n") == 1 and shown in err, err
    assert not (tmp_path / "s").exists()


def test_the_largest_lr_and_seed_the_schema_takes_run_in_adamw_and_torch():
    from mtc.kernels.adamw_ref import adamw_step_ref

    f32max = float(torch.finfo(torch.float32).max)
    cfg = OptimConfig(lr=f32max * (1 - 0.9), min_lr=0.0, beta1=0.9, weight_decay=1.0)
    cfg.validate()  # the bound is the update's own: its first step size, lr / (1 - beta1), is a float32
    p = torch.ones(4)
    adamw_step_ref(p, torch.ones(4), torch.zeros(4), torch.zeros(4), lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2,
                   eps=cfg.eps, weight_decay=cfg.weight_decay, step=1, decay_numel=4)
    with pytest.raises(ConfigError, match=r"optim.lr: AdamW's first step size, lr / \(1 - beta1\) = 3.43685e\+38, overflows a float32"):
        OptimConfig(lr=f32max * (1 - 0.9) * 1.01, min_lr=0.0, beta1=0.9).validate()
    TrainConfig(seed=2**64 - 1).validate()
    torch.manual_seed(2**64 - 1)  # torch's generators take any uint64
    torch.Generator().manual_seed(2**64 - 1)
    with pytest.raises(ConfigError, match=r"config field seed: expected an integer >= 0 and <= 18446744073709551615"):
        TrainConfig(seed=2**64).validate()


def test_cli_device_cuda_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(_train(tmp_path, "--device", "cuda")) == 2
    assert capsys.readouterr().err == (
        "mtc: error: --device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu\n"
    )


def test_cli_flags_reach_the_config(tmp_path):
    a = build_parser().parse_args(_train(
        tmp_path, "--lr", "1e-4", "--clip-norm", "none", "--no-allow-tf32", "--placement", "gpu:0-1,ram:2-5",
        "--gpu-update", "2-3", "--commit-every", "4", "--ram-budget-gb", "32", "--max-nonfinite-steps", "5",
        "--warmup-steps", "0", "--weight-decay", "0", "--durability", "weights", "--compute-dtype", "float32",
    ))
    cfg = _train_config(a)
    assert cfg.optim.lr == 1e-4 and cfg.optim.min_lr == pytest.approx(1e-5, rel=1e-12), "--lr alone: min_lr = lr / 10"
    assert cfg.optim.clip_norm is None and cfg.allow_tf32 is False and cfg.placement == "gpu:0-1,ram:2-5"
    assert (cfg.gpu_update, cfg.commit_every, cfg.ram_budget_gb, cfg.max_nonfinite_steps) == ("2-3", 4, 32.0, 5)
    assert (cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.durability, cfg.compute_dtype) == (0, 0.0, "weights", "float32")


def test_a_lower_lr_flag_keeps_a_config_files_own_min_lr_and_says_when_they_clash(tmp_path):
    (tmp_path / "c.toml").write_text('[optim]\nlr = 0.01\nmin_lr = 0.001\n')
    args = ["train", "--config", str(tmp_path / "c.toml"), "--store", "s", "--data", "d", "--device", "cpu"]
    assert _train_config(build_parser().parse_args([*args, "--lr", "0.002"])).optim.min_lr == 0.001
    with pytest.raises(ConfigError, match=r"optim.min_lr: expected at most optim.lr \(0.0005\), got 0.001"):
        _train_config(build_parser().parse_args([*args, "--lr", "0.0005"]))


def test_lr_given_alone_still_decays_to_a_tenth_of_it(tmp_path):
    # a fixed default min_lr (3e-4) above a fine-tuning lr had been lowered to lr: a flat schedule
    args = ["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", "d", "--device", "cpu"]
    assert _train_config(build_parser().parse_args(args)).optim.min_lr == 3e-4  # the defaults' own, exactly
    assert _train_config(build_parser().parse_args([*args, "--lr", "1e-5"])).optim.min_lr == pytest.approx(1e-6, rel=1e-12)
    (tmp_path / "c.toml").write_text('[optim]\nlr = 1e-5\n')
    assert load_config(tmp_path / "c.toml").optim.min_lr == pytest.approx(1e-6, rel=1e-12)
    (tmp_path / "d.toml").write_text('[optim]\nlr = 0.01\nmin_lr = 0.004\n')  # a config's own ratio, kept by --lr
    cfg = _train_config(build_parser().parse_args([*args[:1], "--config", str(tmp_path / "d.toml"), *args[3:], "--lr", "0.005"]))
    assert cfg.optim.min_lr == 0.004, "a min_lr the config file names is its own"
    from mtc.api import _config

    assert _config(None, {"optim": {"lr": 1e-5}}, None, "cpu").optim.min_lr == pytest.approx(1e-6, rel=1e-12)
    assert _config({"optim": {"lr": 1e-5}}, {}, None, "cpu").optim.min_lr == pytest.approx(1e-6, rel=1e-12)
    base = TrainConfig(optim=OptimConfig(lr=1e-2, min_lr=4e-3))
    assert _config(base, {"optim": {"lr": 5e-3}}, None, "cpu").optim.min_lr == pytest.approx(2e-3, rel=1e-12)
    assert _config(None, {"optim": {"lr": 5e-3, "min_lr": 0.0}}, None, "cpu").optim.min_lr == 0.0
    saved = (1e-3, 3e-4)  # a resumed run's pair: the same lr keeps its min_lr exactly, another keeps the ratio
    assert _config(None, {"optim": {"lr": 1e-3}}, None, "cpu", saved).optim.min_lr == 3e-4
    assert _config(None, {"optim": {"lr": 5e-4}}, None, "cpu", saved).optim.min_lr == pytest.approx(1.5e-4, rel=1e-12)
    assert _config(None, {"optim": OptimConfig(lr=5e-4, min_lr=2e-4)}, None, "cpu", saved).optim.min_lr == 2e-4
    # a TrainConfig's own min_lr is the user's, on a resume too (it had been replaced by the run's ratio)
    assert _config(TrainConfig(optim=OptimConfig(lr=1e-3, min_lr=0.0)), {}, None, "cpu", saved).optim.min_lr == 0.0
    assert _config(TrainConfig(optim=OptimConfig(lr=1e-3, min_lr=0.0)), {"optim": {"lr": 1e-3}}, None, "cpu",
                   saved).optim.min_lr == 3e-4  # (lr given alone: the resumed run's min_lr at its lr)


def test_a_toml_config_writes_none_as_a_string(tmp_path):
    # TOML has no null: `clip_norm = "none"` was refused with a message that offered "none"
    (tmp_path / "c.toml").write_text('ram_budget_gb = "None"\nrank_dir = "none"\n[optim]\nclip_norm = "none"\n')
    cfg = load_config(tmp_path / "c.toml")
    assert (cfg.optim.clip_norm, cfg.ram_budget_gb, cfg.rank_dir) == (None, None, None)
    (tmp_path / "c.toml").write_text('steps = "none"\n')  # not nullable: still refused
    with pytest.raises(ConfigError, match=r"config field steps: expected an integer >= 1, got 'none' \(str\)"):
        load_config(tmp_path / "c.toml")


def test_cli_flags_override_config_file(tmp_path):
    (tmp_path / "c.toml").write_text('steps = 9\nplacement = "ram"\n[optim]\nlr = 0.01\n')
    a = build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml"), "--store", "s", "--data", "d",
                                   "--steps", "3"])
    cfg = _train_config(a)
    assert (cfg.steps, cfg.placement, cfg.optim.lr) == (3, "ram", 0.01)


def test_train_help_lists_presets_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in preset_names():
        assert name in out
    for text in ("--compute-dtype", "--no-allow-tf32", "--clip-norm X|none", "(default: 1.0)", "(default: 200)",
                 "--max-nonfinite-steps", "(default: 3)", "--gpu-update", "--io-threads", "(default: full)"):
        assert text in out, text
    # a new run that names no device takes CUDA where there is one (see the test below): not "default: cpu"
    at = out.index("--device SPEC device")
    device = out[at:out.index("--compute-dtype {", at)]
    assert "(default: cpu)" not in device and "else cuda where this machine has one, else cpu)" in device, device


def test_closed_stdout_exits_quietly(tmp_path):
    """`mtc ... | head`: the reader is gone before mtc prints; exit 1 without a BrokenPipeError traceback."""
    (tmp_path / "t.txt").write_text("a few words\n")
    cmd = [sys.executable, "-m", "mtc", "prepare", str(tmp_path / "t.txt"), "-o", str(tmp_path / "t.bin")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and err == "", err


@pytest.mark.parametrize("device,dtype", [("cuda", "bfloat16"), ("cuda:1", "bfloat16"), ("cpu", "float32")])
def test_the_default_compute_dtype_fits_the_device(device, dtype):
    """The issue's precision defaults: bf16 compute (fp32 master) on CUDA, fp32 on the CPU; a
    dtype the user names wins on either."""
    assert TrainConfig(device=device).resolved_compute_dtype == dtype
    assert TrainConfig(device=device, compute_dtype="float16").resolved_compute_dtype == "float16"


@pytest.mark.parametrize("allow", [True, False])
def test_fp32_compute_on_cuda_runs_tf32_matmuls_unless_told_otherwise(allow):
    """`train` sets the TF32 flags on a CUDA device as ``allow_tf32`` says (default on) and puts
    them back afterwards; on the CPU it leaves them alone (a CPU build keeps the flags too)."""
    from mtc.train import restore_matmul_precision, set_matmul_precision

    assert TrainConfig().allow_tf32 is True
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    outside = flags()
    try:
        restore_matmul_precision((not allow, not allow))
        before = set_matmul_precision(TrainConfig(device="cuda", compute_dtype="float32", allow_tf32=allow), torch.device("cuda"))
        assert before == (not allow, not allow) and flags() == (allow, allow)
        restore_matmul_precision(before)
        assert flags() == (not allow, not allow)
        set_matmul_precision(TrainConfig(device="cpu", allow_tf32=allow), torch.device("cpu"))
        assert flags() == (not allow, not allow)
    finally:
        restore_matmul_precision(outside)


def _record(**kw) -> str:
    """A commit record as a store writes it."""
    from mtc.store import CommitRecord

    return CommitRecord(**{"step": 1, "generation": 1, "data_cursor": 0, "rng_state": {}, "time_unix": 0.0, **kw}).to_json()


def test_a_run_that_names_no_device_computes_on_cuda_where_there_is_one(tmp_path, monkeypatch, capsys):
    """mtc train and mtc.train: no --device (flag, config file or field) means CUDA on a machine
    that has it, said on stderr; a resume keeps its run's device; one that is named is kept."""
    import mtc.api
    import mtc.config

    for mod in (mtc.config, mtc.api):  # the real one (tests/conftest.py pins it to the CPU on a GPU machine)
        monkeypatch.setattr(mod, "auto_device", auto_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _train_config(build_parser().parse_args(_train(tmp_path))).device == "cuda"
    assert "computing on cuda (this machine has one; --device cpu for the CPU)" in capsys.readouterr().err
    assert _train_config(build_parser().parse_args(_train(tmp_path, "--device", "cpu"))).device == "cpu"
    (tmp_path / "c.toml").write_text('model = "tiny"\ndevice = "cpu"\n')
    a = build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml"), "--store", str(tmp_path / "s"), "--data", "d"])
    assert _train_config(a).device == "cpu"
    store = tmp_path / "run"
    store.mkdir()
    (store / "commit.json").write_text(_record(step=3, config={**TrainConfig(model="tiny").to_dict(), "device": "cpu"}))
    a = build_parser().parse_args(["train", "--preset", "tiny", "--store", str(store), "--data", "d"])
    assert _train_config(a).device == "cpu"  # the run being resumed was on the CPU
    assert mtc.api._config({"model": "tiny"}, {}, None, "cpu").device == "cpu"  # so with a config naming no device
    # a seeded store (mtc import, --init-from) records only its model: training it is a new run
    seeded = tmp_path / "imported"
    seeded.mkdir()
    (seeded / "commit.json").write_text(_record(step=0, meta={"init": {"source": "hf"}},
                                                config={**TrainConfig(model="tiny").to_dict(), "device": "cpu"}))
    a = build_parser().parse_args(["train", "--preset", "tiny", "--store", str(seeded), "--data", "d"])
    assert _train_config(a).device == "cuda"
    capsys.readouterr()
    # --stop-after with durability none on a store with a commit: a later run starts from it, not from step 0
    (tmp_path / "five").mkdir()
    (tmp_path / "five" / "commit.json").write_text(_record(step=5, config={**TrainConfig(model="tiny").to_dict(), "device": "cpu"}))
    with pytest.raises(ConfigError, match=r"would start again from the store's last commit, step 5; use --durability"):
        _train_config(build_parser().parse_args(["train", "--preset", "tiny", "--store", str(tmp_path / "five"), "--data", "d",
                                                 "--stop-after", "9", "--durability", "none", "--device", "cpu"]))
    # a refusal stays one line: the device note comes only once the config checks out
    with pytest.raises(ConfigError):
        _train_config(build_parser().parse_args(_train(tmp_path, "--stop-after", "2", "--durability", "none")))
    assert "computing on" not in capsys.readouterr().err
    assert mtc.api._config(None, {}, None).device == "cuda"
    assert mtc.api._config(None, {"device": "cpu"}, None).device == "cpu"
    assert mtc.api._config({"model": "tiny"}, {}, None).device == "cuda"
    assert mtc.api._config(None, {}, {**TrainConfig().to_dict(), "device": "cpu"}).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _train_config(build_parser().parse_args(_train(tmp_path))).device == "cpu"
    assert mtc.api._config(None, {}, None).device == "cpu"
