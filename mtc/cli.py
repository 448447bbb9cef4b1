"""The `mtc` command line: parses arguments and calls library functions, nothing else."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mtc.errors import MTCError

__all__ = ["main"]


def _cmd_demo(a: argparse.Namespace) -> int:
    from mtc.demo import check_demo, run_demo
    from mtc.progress import ProgressBar

    check_demo(a.dir, a.steps)  # before the first line says it is training
    print(f"mtc demo: training the `tiny` Llama on the embedded corpus for {a.steps} steps, through the store in {a.dir}/store")
    bar = ProgressBar(a.steps)
    res = run_demo(a.dir, steps=a.steps, on_step=lambda r: bar.update(r.step, loss=r.loss, lr=r.lr))
    print(f"loss {res.first_loss:.3f} -> {res.last_loss:.3f} in {res.steps} steps, {res.train_s:.1f} s")
    print("sample:\n" + res.sample)
    return 0


# TrainConfig fields a user sets per run, as `mtc train` flags (--micro-batch-size, --lr, ...); the
# help text, accepted values and defaults come from the schema in mtc.config.
_TRAIN_FLAGS = (
    "steps", "micro_batch_size", "seq_len", "grad_accum", "seed", "device", "compute_dtype", "allow_tf32", "kernels",
    "placement", "gpu_update", "update_prefetch", "update_handoff", "durability", "commit_every", "activation_budget_gb", "ram_budget_gb",
    "gpu_budget_gb", "optim_threads", "host_adamw", "io_threads", "max_nonfinite_steps", "disk_compute", "eval_every", "eval_batches",
    "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "optim.clip_norm",
    "cuda_graphs",
    "dist_timeout_s",
    "matmul_fusion",
    "dp_collectives",
    "rank_dir",
    "save_activations",
)
_BOOL_FLAGS = ("allow_tf32", "update_handoff")  # --X / --no-X


def _flag(path: str) -> str:
    return "--" + path.rpartition(".")[2].replace("_", "-")


def _dest(path: str) -> str:
    return path.rpartition(".")[2]


def _train_config(a: argparse.Namespace):  # -> TrainConfig
    from mtc.config import TrainConfig, check_device, config_file_fields, min_lr_for, parse_field, set_field
    from mtc.errors import ConfigError
    from mtc.plan import compile_command

    plan_fields = None
    file_fields = config_file_fields(a.config) if a.config else None
    if getattr(a, "plan", None):
        from mtc.user_model import plan_train_fields

        plan_fields = plan_train_fields(a.plan)  # a preset's (mtc compile) or a user's model (mtc.save_plan)
        cfg = TrainConfig(**plan_fields)
    elif a.config or a.preset or getattr(a, "model", None):
        cfg = TrainConfig.from_dict(file_fields) if file_fields is not None else TrainConfig(model=a.preset or a.model)
    else:
        cfg = _stored_config(a)
    ref = (cfg.optim.lr, cfg.optim.min_lr)  # before the flags: what an unnamed min_lr keeps its ratio to
    given = {}
    for path in _TRAIN_FLAGS:
        raw = getattr(a, _dest(path))
        if raw is not None:
            given[path] = parse_field(path, raw, flag=_flag(path))
    for path, val in given.items():
        if plan_fields is not None and path in plan_fields and val != plan_fields[path]:
            if path == "compute_dtype" and val == "auto":
                probe = TrainConfig(compute_dtype="auto", device=given.get("device", cfg.device))
                if probe.resolved_compute_dtype == plan_fields[path]:
                    continue  # auto means the plan's dtype on this device: the same run
            raise _plan_conflict(a.plan, plan_fields, path, val)
        set_field(cfg, path, val)
    device_note = ""
    if "device" not in given and "device" not in (file_fields or {}):
        cfg.device, device_note = _unnamed_device(a)
    # a min_lr named by a flag or the config file is kept (and checked); unnamed, it keeps its ratio
    # to lr: the resumed run's (a resume with the same lr keeps its min_lr), else the config's
    # before --lr (the defaults: lr / 10), so a lower --lr alone still decays
    if "optim.min_lr" not in given and "min_lr" not in ((file_fields or {}).get("optim") or {}):
        saved = _saved_optim(a)
        if saved is not None or "optim.lr" in given:
            cfg.optim.min_lr = min_lr_for(cfg.optim.lr, *(saved or ref))
    if a.stop_after is not None and a.stop_after < 1:
        raise ConfigError(
            f"--stop-after: expected a step number >= 1 (stop once that step is committed), got {a.stop_after}; "
            "omit it to train to --steps"
        )
    if a.stop_after is not None and cfg.durability == "none":
        from mtc.train import last_committed_step

        last = None if a.overwrite else last_committed_step(a.store)
        where = f"the store's last commit, step {last}" if last else "step 0"
        raise ConfigError(
            f"--stop-after {a.stop_after} with --durability none: this run would commit nothing, so the steps it trains "
            f"would be lost and a later run would start again from {where}; use --durability weights or full, or drop "
            "--stop-after"
        )
    cfg.validate()
    check_device(cfg)
    if device_note:
        print(device_note, file=sys.stderr)
    if plan_fields is not None and cfg.device == "cpu" and cfg.kernels == "auto":
        print(_plan_on_cpu_note(a.plan), file=sys.stderr)
    if plan_fields is not None and cfg.device.startswith("cuda") and cfg.compute_dtype == "float32":
        print(f"note: plan {a.plan} was compiled for float32: this run computes in fp32 (TF32 matmuls); on CUDA bf16 "
              f"is the default and several times faster: `{compile_command(a.plan, plan_fields, compute_dtype='bfloat16')}`",
              file=sys.stderr)
    return cfg


def _plan_on_cpu_note(plan: str) -> str:
    """What a CPU run with --kernels auto does with plan directory ``plan``'s kernels (it runs the
    unfused templates), in the words that fit what the plan holds."""
    from mtc.plan import kernels_target

    target = kernels_target(plan)
    if target is None:
        what = f"plan {plan} holds no generated kernels"
    elif target == "cpu-interpreter":
        what = f"plan {plan}'s generated kernels were compiled on the CPU, for Triton's interpreter"
    else:
        what = f"plan {plan}'s generated kernels were compiled for CUDA ({target})"
    return (f"note: {what}: on the CPU this run uses the unfused (ATen) templates (--kernels fused would run generated "
            "kernels in Triton's interpreter, slowly)")


def _unnamed_device(a: argparse.Namespace) -> tuple[str, str]:
    """The device of a train command that names none: the resumed run's, else CUDA where there is
    one; and the note that says so (printed once the config checks out: errors stay one line)."""
    from mtc.config import auto_device
    from mtc.warmstart import run_device

    stored = run_device(a.store) if a.store and not a.overwrite else None
    if stored is not None:
        return stored, ""
    dev = auto_device()
    return dev, f"mtc: computing on {dev} (this machine has one; --device cpu for the CPU)" if dev != "cpu" else ""


def _saved_optim(a: argparse.Namespace) -> tuple[float, float] | None:
    """(lr, min_lr) of the run a train command resumes; None for a new run (or one it overwrites)."""
    from mtc.config import lr_pair
    from mtc.warmstart import run_config

    return None if a.overwrite else lr_pair(run_config(a.store))


def _stored_config(a: argparse.Namespace):  # -> TrainConfig
    """The config of a train command that names no model: the resumed run's whole config (as
    ``mtc.train(store=...)`` takes it: a resume given only --data and the flags it changes); else
    the model of the store's seed (an import) or of --init-from's source, on the defaults."""
    import dataclasses

    from mtc.config import TrainConfig
    from mtc.errors import ConfigError
    from mtc.warmstart import run_config, run_model, source_model

    saved = run_config(a.store) if not a.overwrite else None
    if saved is not None:
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        return TrainConfig.from_dict({k: v for k, v in saved.items() if k in known})
    fields = run_model(a.store) if not a.overwrite else None
    if fields is None and a.init_from:
        fields = source_model(a.init_from)
    if fields is None:
        raise ConfigError(f"store {a.store} holds no run to take the model from; give --preset, --config or --plan "
                          "(or --init-from a run or Hugging Face checkpoint)")
    return TrainConfig(**fields)


def _plan_conflict(plan: str, fields: dict, path: str, val: object) -> MTCError:
    """The refusal of a flag that sets ``path`` to ``val`` where plan directory ``plan`` fixed it
    (its shape and dtype are the program's: `mtc train` and `mtc plan` refuse alike)."""
    from mtc.errors import ConfigError
    from mtc.plan import compile_command

    return ConfigError(f"plan {plan} was compiled for {path}={fields[path]}, not {val}; drop {_flag(path)} or recompile "
                       f"with `{compile_command(plan, fields, **{path: val})}`")


_DURABILITY = {"full": "exact resume from the last commit", "weights": "a resume restarts Adam's moments",
               "none": "nothing committed: no resume"}


def _durability_text(cfg: object, program: object = None) -> str:
    """The run's durability mode for its log, with what it means and how often it commits (with
    ``program``: as the run's placement decides, which `auto` may put on disk)."""
    every = "" if cfg.durability == "none" else f", a commit every {cfg.commit_every} steps" if cfg.commit_every \
        else ", commits paced to the disk (commit_every 0)"
    if every and "disk" in _placement_of(cfg, program):  # disk layers write their state every step, into the other generation
        every = ", a commit every step (layers' state on disk)"
    return f"durability {cfg.durability} ({_DURABILITY[cfg.durability]}{every})"


def _say_schedule_change(run: object, cfg: object, start: int) -> None:
    """A resume that changed the schedule's fields (--allow-change steps, optim.lr, ...) follows
    the new curve from here: say where the learning rate goes at once, beside the old curve's
    (and that a new seed draws new validation batches)."""
    if "seed" in run.changes and cfg.eval_every:
        print(f"note: the validation batches are drawn with the seed too: val_loss from step {start} on is taken on "
              "other batches than before", file=sys.stderr)
    fields = {"steps", "optim.lr", "optim.min_lr", "optim.warmup_steps"} & set(run.changes)
    if not fields:
        return
    import dataclasses

    from mtc.runtime.schedule import lr_at

    old_cfg = cfg.optim
    for f in fields - {"steps"}:
        old_cfg = dataclasses.replace(old_cfg, **{f.split(".", 1)[1]: run.change_values[f][0]})
    old_steps = run.change_values["steps"][0] if "steps" in fields else cfg.steps
    old, new = lr_at(start, old_steps, old_cfg), lr_at(start, cfg.steps, cfg.optim)
    if old != new:
        print(f"note: the schedule follows the changed {', '.join(sorted(fields))} from step {start}: the learning rate "
              f"goes from {old:.4g} (the old curve's) to {new:.4g}", file=sys.stderr)


def _placement_of(cfg: object, program: object) -> list[str] | str:
    """The tiers the run will use (as `mtc.train.train` plans them), or the config's text without a program."""
    if program is None or cfg.placement.strip() != "auto":
        return cfg.placement
    from mtc.train import plan_placement, run_disk_compute

    try:
        return plan_placement(cfg, program, disk_compute=run_disk_compute(cfg, program))[0]
    except MTCError:  # (train reports it, in its own words)
        return cfg.placement


def _cmd_train_run(a: argparse.Namespace) -> int:
    from mtc.data import TokenFile
    from mtc.progress import ProgressBar
    from mtc.train import open_run, train

    cfg = _train_config(a)
    tokens = TokenFile.open(a.data)  # before the store: a bad data path must not leave a new store behind
    if a.tensorboard:
        from mtc.tensorboard import check_log_dir

        check_log_dir(a.tensorboard)  # likewise a --tensorboard path that is a file
    world = _train_world(cfg, a.store)
    if not world.is_root:
        return _cmd_train_rank(a, cfg, tokens)
    allow = tuple(f.strip() for f in (a.allow_change or "").split(",") if f.strip())
    try:
        run = open_run(cfg, a.store, overwrite=a.overwrite, plan=a.plan, data=tokens, allow_change=allow,
                       init_from=a.init_from)
    except BaseException as e:
        if world.distributed:
            from mtc import dist

            dist.root_failed(world, e)  # the other ranks wait for the store: they stop with this reason
        raise
    start = run.start_step
    if start >= cfg.steps:
        run.store.close()
        print(f"store {a.store} is already at step {start} of {cfg.steps}; nothing to do")
        return 0
    if a.stop_after is not None and a.stop_after <= start:
        run.store.close()
        print(f"store {a.store} is already at step {start}, at or past --stop-after {a.stop_after}; nothing to do")
        return 0
    print(f"mtc train: {cfg.model} from step {start} to {cfg.steps if a.stop_after is None else min(cfg.steps, a.stop_after)}, "
          f"store {a.store}, device {cfg.device}, {_durability_text(cfg, run.program)}")
    print(json.dumps(cfg.to_dict()))
    _say_schedule_change(run, cfg, start)
    sink = None
    if a.tensorboard:
        from mtc.tensorboard import TensorBoardSink

        try:
            sink = TensorBoardSink(a.tensorboard, start_step=start)
        except BaseException:
            run.store.close()
            raise
    _print_mfu_denominator(cfg)
    bar = ProgressBar(cfg.steps, initial=start)
    watch = _stage_watch(cfg, run.program)

    def on_step(r: object) -> None:
        _show_step(bar, r)
        if sink is not None:
            sink.write(r)

    try:
        res = train(cfg, a.store, tokens, stop_after=a.stop_after, run=run, on_step=on_step,
                    notify=lambda m: print(f"mtc: {m}", file=sys.stderr), watch=watch)
    except (KeyboardInterrupt, _Terminated) as e:
        bar.close()
        code = 143 if isinstance(e, _Terminated) else 130
        what = "terminated (SIGTERM)" if code == 143 else "interrupted"
        print(f"mtc: {what}; {_last_commit_text(a.store)}", file=sys.stderr)
        return code
    except BaseException:
        bar.close()
        raise
    finally:
        if sink is not None:
            sink.close()
        if world.distributed:
            from mtc import dist

            dist.shutdown_world()
    bar.close()
    res.store.close()
    if res.losses:
        print(f"steps {res.start_step}->{res.end_step}: loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}, {res.wall_s:.1f} s")
    for line in res.graph_report:  # compile time and CUDA-graph replay per template
        print(line)
    if watch is not None and watch.summary():
        print(f"stages vs the plan (machine profile {watch.plan.profile.name!r}): " + "; ".join(watch.summary())
              + (f" (the profile warns: {watch.plan.profile.busy})" if watch.plan.profile.busy else ""))
    return 0


def _train_world(cfg: object, store: str) -> object:
    """Join torchrun's process group (nothing without torchrun) and check the run can be split."""
    from mtc import dist

    dist.check_launch(cfg, dist.current_world(), store)  # before joining: every rank would refuse alike
    return dist.init_world(cfg.device, cfg.dist_timeout_s)


def _cmd_train_rank(a: argparse.Namespace, cfg: object, tokens: object) -> int:
    """`mtc train` on a data-parallel rank other than 0: train quietly beside rank 0 (which reports)."""
    from mtc import dist
    from mtc.train import last_committed_step, train

    try:
        start = last_committed_step(a.store)
        if start is not None and not a.overwrite and (start >= cfg.steps or (a.stop_after is not None
                                                                            and a.stop_after <= start)):
            return 0  # rank 0 says so
        res = train(cfg, a.store, tokens, stop_after=a.stop_after)
        res.store.close()
    except (KeyboardInterrupt, _Terminated) as e:
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        dist.shutdown_world()
    return 0


def _stage_watch(cfg: object, program: object) -> object:
    """A StageWatch over the run's plan on the last `mtc calibrate` profile, if there is one."""
    import socket

    from mtc.calibrate import DEFAULT_PROFILE_PATH, MachineProfile
    from mtc.planner import make_plan
    from mtc.stagewatch import StageWatch

    if not DEFAULT_PROFILE_PATH.is_file():
        return None
    try:
        prof = MachineProfile.load(DEFAULT_PROFILE_PATH)
        if prof.identity.get("host") != socket.gethostname():
            return None  # measured on another machine: its figures say nothing about this one
        return StageWatch(make_plan(cfg, prof, program=program))
    except MTCError:  # the comparison is advice: a profile that cannot plan this run must not stop it
        return None


class _ReaderMayGo:
    """A text stream whose reader may go away (``mtc train | head``, a closed pipe): training goes
    on, and what it prints from then on goes to /dev/null instead of raising BrokenPipeError."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _cmd_train(a: argparse.Namespace) -> int:
    """`mtc train`, its output surviving a reader that goes away (see `_ReaderMayGo`)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ReaderMayGo(out), _ReaderMayGo(err)
    try:
        return _cmd_train_run(a)
    finally:
        sys.stdout, sys.stderr = out, err


def _show_step(bar: object, r: object) -> None:
    """Progress, plus one line for a step skipped because its loss or gradient norm was not finite."""
    if r.skipped:
        bar.close()
        print(f"mtc: step {r.step} skipped: loss {r.loss}, gradient norm {r.grad_norm} (not finite); "
              "the weights were not updated", file=sys.stderr)
    from mtc.progress import step_fields

    bar.update(r.step, **step_fields(r))
    if r.val_loss is not None:
        bar.write(f"val: step {r.step} loss {r.val_loss:.4f} perplexity {_ppl(r.val_loss):.4g} ({r.eval_s:.2f} s)")


def _ppl(loss: float) -> float:
    import math

    return math.exp(loss) if loss < 700 else math.inf


def _print_mfu_denominator(cfg: object) -> None:
    from mtc.metrics import peak_rate

    peak = peak_rate(cfg.device, cfg.resolved_compute_dtype, allow_tf32=cfg.allow_tf32)
    print(f"MFU denominator: {f'{peak.tflops:g} TFLOP/s, ' if peak.tflops else ''}{peak.source}")


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so the run stops the way Ctrl-C stops it."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def _last_commit_text(store_dir: str) -> str:
    """What the store holds now, read back from disk (so the message is true, whatever happened)."""
    from mtc.train import last_committed_step

    try:
        step = last_committed_step(store_dir)
    except Exception as e:  # the message must not hide the interruption behind a second error
        return f"the store's last commit could not be read ({e})"
    if step is None:
        return f"store {store_dir} has no commit yet: the same command starts the run over"
    return f"store {store_dir} keeps its last commit, step {step}: the same command resumes from there"


def _cmd_inspect(a: argparse.Namespace) -> int:
    from mtc.store import verify
    from mtc.weight_sources import open_run_store

    # read-only: no lock, so it works while a training run holds the store
    with open_run_store(a.store) as st:
        report = verify(st, check_chunks=a.verify)
        damaged = {p.array for p in report.problems if p.array is not None and p.chunk is None}
        names = st.array_names()
        total = 0
        for name in names:
            if name in damaged:
                continue  # its problem is printed below
            info = st.array_info(name)
            total += info.nbytes
            if a.arrays:
                print(f"{name:32s} {str(info.dtype).removeprefix('torch.'):9s} {info.shape!s:16s} {info.nbytes / 2**20:9.2f} MiB")
        print(f"store {a.store}: {len(names)} arrays, {total / 2**20:.1f} MiB")
        try:
            last = st.last_commit()
        except MTCError:
            last = None  # a missing or garbled commit.json: one of the problems below
        if last is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.time_unix))
            print(f"last commit: step {last.step} of {last.config.get('steps')}, generation {last.generation}, "
                  f"durability {last.durability}, data cursor {last.data_cursor}, at {when}, model {last.config.get('model')}")
            from mtc.changes import describe_history

            for line in describe_history(last.meta.get("changes", [])):  # what --allow-change let differ, and when
                print(f"changed {line}")
    if a.verify:
        print("\n".join(report.lines()))
    else:
        for p in report.problems:
            print(f"damaged: {p}")
        if not report.ok:
            # the fix depends on the damage: a lost commit.json is restored, damaged state rolled back
            print(f"{len(report.problems)} problem(s); `mtc verify {a.store}` checks every chunk; " + "; ".join(report.fixes()))
    return 0 if report.ok else 1


def _cmd_verify(a: argparse.Namespace) -> int:
    from mtc import shards
    from mtc.store import TensorStore, verify

    with TensorStore.open(a.store, read_only=True) as st:
        report = verify(st)
    plan_lines = _verify_plan(Path(a.store), report.record)
    plan_ok = not plan_lines
    lines = report.lines()
    if not plan_ok and lines[-1] == "healthy":
        lines[-1] = "the state is whole"
    print("\n".join(lines + plan_lines))
    if report.record is not None and shards.is_sharded(report.record):  # and every rank's shard store
        ok, lines = shards.verify_sharded(Path(a.store), report.record)
        print("\n".join(lines))
        return 0 if report.ok and ok and plan_ok else 1
    return 0 if report.ok and plan_ok else 1


def _verify_plan(store: Path, record: object) -> list[str]:
    """Nothing when the run's plan (its traced model, ``STORE/plan``) loads; else what is damaged
    and how to write it again (eval, generate, export and a resume all read it: the store alone
    said "healthy" beside a deleted program.json)."""
    from mtc.errors import PlanError
    from mtc.plan import load_plan
    from mtc.user_model import is_factory_path

    if not (store / "plan").is_dir():
        return []  # (a store written without a plan: not a training run's)
    try:
        load_plan(store / "plan")
        return []
    except PlanError as e:
        out = [f"damaged: plan: {e}"]
    cfg = getattr(record, "config", None) or {}
    model, b, t = cfg.get("model"), cfg.get("micro_batch_size"), cfg.get("seq_len")
    if model and not is_factory_path(str(model)) and model != "custom" and not cfg.get("model_overrides") and b and t:
        from mtc.config import TrainConfig

        dtype = TrainConfig.from_dict(cfg).resolved_compute_dtype
        out.append(f"the weights are intact: `mtc trace {model} -o {store / 'plan'} --micro-batch-size {b} --seq-len {t} "
                   f"--dtype {dtype}` writes the plan again")
    else:
        out.append(f"the weights are intact: restore {store / 'plan'} from a copy, or save it again from the model "
                   f"(mtc.save_plan(mtc.trace(model, {b}, {t}), '{store / 'plan'}'), with factory= if the run names one)")
    return out


def _cmd_repair(a: argparse.Namespace) -> int:
    from mtc.store import TensorStore, repair

    from mtc import shards

    with TensorStore.open(a.store) as st:  # takes the lock: no run may commit meanwhile
        # a data-parallel run's record is whole when every rank's shard of it is; a rank's shard
        # store is not rolled back alone while its run's record names it
        done = repair(st, shard_state=functools.partial(shards.run_state_problems, Path(a.store)),
                      in_run=shards.named_in_run(st))
        record = st.last_commit()
    print("\n".join(done.actions))
    if shards.is_sharded(record):  # a data-parallel run: every rank's shard store too
        for r, path in enumerate(shards.require_visible(Path(a.store), record, "mtc repair")):
            with TensorStore.open(path) as rs:
                print("\n".join(f"rank {r}: {x}" for x in repair(rs, in_run=shards.named_in_run(rs)).actions))
    return 0


def _versions() -> str:
    """mtc's version and those of the libraries it runs on (read from the installed metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"mtc {v('mtc')} (torch {v('torch')}, triton {v('triton')}, zarr {v('zarr')}, Python {sys.version.split()[0]})"


class _VersionAction(argparse.Action):
    """``--version``: the versions are looked up only when asked for (reading the packages' metadata
    took ~30 ms, which every other command would pay when the parser is built)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *a: object) -> None:
        print(_versions())  # (on stdout, as argparse's own version action prints)
        parser.exit()


def _cmd_prepare(a: argparse.Namespace) -> int:
    from mtc.data import prepare
    from mtc.data.tokens import token_file_paths

    existed = token_file_paths(a.output)[0].is_file()
    tf = prepare([Path(p) for p in a.inputs], Path(a.output), tokenizer=a.tokenizer, fmt=a.format, field=a.field,
                 prompt_field=a.prompt_field, response_field=a.response_field, messages_field=a.messages_field,
                 eos_token=a.eos, skip_bad_records=a.skip_bad_records,
                 log=lambda m: print(f"note: {m}", file=sys.stderr))
    h = tf.header
    docs = f", {h.docs['n_docs']:,} documents" if h.docs else ""
    mask = f", {h.mask['n_targets']:,} of them loss targets" if h.mask else ""
    print(f"wrote {len(tf):,} tokens{mask}{docs} ({h.dtype}, tokenizer {h.tokenizer}, vocab {h.vocab_size}"
          f"{'' if h.eos_id is None else f', EOS {h.eos_id}'}) to {tf.path}")
    src = h.source or {}
    if src.get("empty"):
        print(f"note: {src['empty']:,} of the {src['read']:,} documents read had no text (no tokens): left out",
              file=sys.stderr)
    if src.get("skipped"):
        shown = len(src["skipped_examples"])
        which = "they were" if shown == src["skipped"] else f"the first {shown}"
        print(f"note: skipped {src['skipped']:,} bad records (--skip-bad-records); {which}:", file=sys.stderr)
        for ex in src["skipped_examples"]:
            print(f"  {ex}", file=sys.stderr)
    if tf.tokenizer_dir is not None:
        print(f"tokenizer files copied to {tf.tokenizer_dir}")
    if existed:  # (runs trained on the old file refuse this one on resume unless told: --allow-change data)
        print(f"note: replaced the token file that was at {tf.path}", file=sys.stderr)
    return 0


def _cmd_trace(a: argparse.Namespace) -> int:
    from mtc.config import TrainConfig
    from mtc.plan import save_plan
    from mtc.trace_cache import trace_preset
    from mtc.tracer import trace
    from mtc.train import build_model
    from mtc.user_model import write_model_record

    a.dtype, said = _compile_dtype(a)
    cfg = TrainConfig(model=a.preset, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size, compute_dtype=a.dtype)
    cfg.validate()
    if said:
        print(said)
    if a.meta:  # on the meta device a preset's program is the trace cache's (traced once per machine)
        program = trace_preset(cfg, name=a.preset)
    else:
        program = trace(build_model(cfg, device="cpu"), a.micro_batch_size, a.seq_len, name=a.preset)
    save_plan(program, a.output)
    write_model_record(a.output, cfg.to_dict(), program)  # what `mtc train --plan` and `mtc plan` read: the preset, shapes, dtype
    print(program.summary())
    print(f"plan written to {a.output}")
    return 0


def _compile_dtype(a: argparse.Namespace) -> tuple[str, str]:
    """``--dtype``, with auto resolved as `mtc train` resolves its compute dtype on this machine, and
    the line that says so (printed once the model checks out: a refusal stays one line)."""
    if a.dtype != "auto":
        return a.dtype, ""
    import torch

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return dtype, f"compute dtype {dtype} (--dtype auto: {'CUDA' if dtype == 'bfloat16' else 'no CUDA'} here)"


def _cmd_compile(a: argparse.Namespace) -> int:
    a.dtype, said = _compile_dtype(a)
    if a.factory is not None or (a.model is not None and ":" in a.model):
        return _cmd_compile_user_model(a, said)
    if a.model is None:
        from mtc.errors import ConfigError

        raise ConfigError("mtc compile needs a model: a preset (mtc compile tiny -o DIR) or a factory by import path "
                          "(mtc compile --model package.module:function -o DIR)")
    from mtc.compiler import compile_program, write_report
    from mtc.config import TrainConfig
    from mtc.plan import save_plan
    from mtc.trace_cache import trace_preset
    from mtc.user_model import write_model_record

    cfg = TrainConfig(model=a.model, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size, compute_dtype=a.dtype,
                      matmul_fusion=a.matmul_fusion)
    cfg.validate()
    if said:
        print(said)
    program = trace_preset(cfg, name=a.model)  # traced on the meta device, once per machine (mtc/trace_cache.py)
    out = Path(a.output)
    save_plan(program, out)
    write_model_record(out, cfg.to_dict(), program)
    compiled = compile_program(program, out / "kernels", matmul_fusion=cfg.matmul_fusion, allow_tf32=cfg.allow_tf32)
    print(write_report(program, compiled, out))
    print(f"plan and kernels written to {out}")
    return 0


def _cmd_import(a: argparse.Namespace) -> int:
    from mtc.hf import import_hf

    r = import_hf(a.hf_dir, a.store, overwrite=a.overwrite)
    tok = f"tokenizer files: {', '.join(r.tokenizer_files)}" if r.tokenizer_files else "no tokenizer files found"
    print(f"imported {r.architecture} ({r.n_params:,} parameters, {r.tensors} tensors) into {r.store} as model "
          f"{r.model!r} in {r.seconds:.1f} s; {tok}")
    print(f"fine-tune it with: mtc train --store {r.store} --data TOKENS.bin --steps N")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from mtc.hf import export_hf
    from mtc.hf.exporter import parse_size

    r = export_hf(a.run, a.output, dtype=a.dtype, step=a.step, max_shard_bytes=parse_size(a.max_shard_size),
                  tokenizer=a.tokenizer)
    tok = (f"tokenizer files from {r.tokenizer_source}" if r.tokenizer_files
           else "no tokenizer files (the run has none; pass --tokenizer DIR to add them)")
    print(f"exported step {r.step} of {a.run} to {r.directory}: {len(r.shards)} shard(s), {r.total_bytes / 2**20:.1f} MiB "
          f"{r.dtype}, {tok}; {r.seconds:.1f} s")
    return 0


def _cmd_reshard(a: argparse.Namespace) -> int:
    from mtc.shards import reshard

    reshard(Path(a.store), a.world_size, template=a.rank_dir, log=print)
    return 0


# run fields `mtc plan` takes as flags (the rest come from the preset, plan or config file); every
# flag a fit check's advice names is among them, so the advice runs with `mtc plan` as with `mtc train`
_PLAN_FLAGS = ("micro_batch_size", "seq_len", "grad_accum", "compute_dtype", "placement", "gpu_update", "update_prefetch", "update_handoff", "durability",
               "commit_every", "activation_budget_gb", "ram_budget_gb", "gpu_budget_gb", "optim_threads", "cuda_graphs",
               "save_activations", "disk_compute")


def _cmd_plan(a: argparse.Namespace) -> int:
    from mtc.calibrate import load_machine
    from mtc.config import TrainConfig, load_config, parse_field, set_field
    from mtc.plan import load_plan
    from mtc.planner import extrapolations, largest_fit, make_plan, stateless_alternative
    from mtc.user_model import plan_train_fields

    program, plan_fields = None, None
    if a.config:
        cfg = load_config(a.config)
    elif a.target is None:
        raise MTCError("mtc plan needs a preset, a plan directory or --config FILE; e.g. `mtc plan 8b --machine h100-box`")
    elif Path(a.target).is_dir():
        program = load_plan(a.target)
        # as `mtc train --plan` reads it (a plan saved from Python may record a factory, or no model.json)
        plan_fields = plan_train_fields(a.target)
        cfg = TrainConfig(**plan_fields)
    else:
        cfg = TrainConfig(model=a.target)
    auto_dtype = False
    for path in _PLAN_FLAGS:
        raw = getattr(a, _dest(path))
        if raw is None:
            continue
        val = parse_field(path, raw, flag=_flag(path))
        if plan_fields is not None and path in plan_fields and val != plan_fields[path]:
            if path == "compute_dtype" and val == "auto":
                auto_dtype = True  # the plan's dtype if auto means it on the planned machine (below)
                continue
            raise _plan_conflict(a.target, plan_fields, path, val)  # `mtc train --plan` would refuse it
        set_field(cfg, path, val)
    cfg.validate()  # (an unknown preset is the first thing to hear about, before any measuring)
    profile = load_machine(a.machine, quick=_measure_machine)
    if auto_dtype and ("bfloat16" if profile.accelerator == "cuda" else "float32") != plan_fields["compute_dtype"]:
        raise _plan_conflict(a.target, plan_fields, "compute_dtype", "auto")
    if a.world_size != 1 or a.nodes != 1:
        return _plan_world(a, cfg, profile, program)
    plan = make_plan(cfg, profile, program=program)
    print("\n".join(plan.lines()))
    _, alt = stateless_alternative(plan, program)
    if alt:
        print(alt)
    if not a.no_extrapolate:
        print("\nextrapolations (built-in machine profiles; their assumed figures are listed with them):")
        print("\n".join(extrapolations()))
        sizes = largest_fit(profile)
        print(f"\nlargest Llama-8b-shaped model whose fp32 state (master, m, v) fits {profile.name} (GPU + RAM + disk):")
        for mode, n in sizes.items():
            print(f"  durability {mode:7s} {n / 1e9:8.2f}B parameters" if n else f"  durability {mode:7s} none fits")
    return 0 if plan.fits else 1


def _measure_machine():  # -> MachineProfile
    """`mtc plan` with no --machine and no saved profile: calibrate this machine now, and save it."""
    from mtc.calibrate import DEFAULT_PROFILE_PATH, calibrate

    print("mtc: no machine profile saved yet: measuring this machine as `mtc calibrate` does (10-20 s)", file=sys.stderr)
    prof = calibrate()
    out = prof.save(DEFAULT_PROFILE_PATH)
    print(f"mtc: profile saved to {out}; later plans reuse it (`mtc calibrate` measures again)", file=sys.stderr)
    return prof


def _plan_world(a: argparse.Namespace, cfg: object, profile: object, program: object) -> int:
    """`mtc plan --world-size N [--nodes K]`: one rank's plan, its host's totals and the scaling table."""
    from mtc.dist_plan import DistPlan, make_dist_plan, scaling

    plan = make_dist_plan(cfg, profile, a.world_size, nodes=a.nodes, program=program, engine=a.dp_model)
    print("\n".join(plan.lines()))
    per_host = plan.layout.ranks_per_host if isinstance(plan, DistPlan) else 1
    print()
    print("\n".join(scaling(cfg, profile, plan.shape, max(per_host, profile.gpus_per_host if a.nodes == 1 else per_host),
                            engine=a.dp_model)))
    return 0 if plan.fits else 1


def _cmd_calibrate(a: argparse.Namespace) -> int:
    from mtc.calibrate import DEFAULT_PROFILE_PATH, calibrate, check_profile_path

    check_profile_path(a.output or DEFAULT_PROFILE_PATH)  # before the measuring: it takes ~30 s
    prof = calibrate(directory=a.dir)
    out = prof.save(a.output or DEFAULT_PROFILE_PATH)
    pcie = "memcpy (no GPU: no PCIe link to measure)" if prof.pcie_is_memcpy else "pinned"
    print(f"machine: {prof.device}; {prof.cores} cores, {prof.host_memory_bytes / 2**30:.1f} GiB RAM"
          + (f", GPU {prof.gpu_memory_bytes / 2**30:.1f} GiB" if prof.gpu_memory_bytes else ""))
    print(f"host->device {prof.h2d_gbps:.1f} GB/s, device->host {prof.d2h_gbps:.1f} GB/s, both {prof.both_gbps:.1f} GB/s ({pcie})")
    print(f"disk at {prof.disk_dir} (page cache dropped): write {prof.disk_write_gbps:.2f} GB/s, read {prof.disk_read_gbps:.2f} GB/s; "
          f"through the store: write {prof.store_write_gbps:.2f}, read {prof.store_read_gbps:.2f}, both at once {prof.store_both_gbps:.2f} GB/s; "
          f"a commit's fixed cost {prof.commit_latency_s * 1e3:.0f} ms, {prof.commit_file_s * 1e3:.1f} ms per further chunk file")
    print(f"CPU AdamW ({prof.adamw_impl}, {prof.cores} threads): {prof.adamw_rate:.2f} G params/s; "
          f"matmul ({prof.matmul_dtype}): {prof.matmul_tflops:.3f} TFLOP/s (median of {len(prof.matmul)} shapes; fastest "
          f"{max(p['tflops'] for p in prof.matmul):.3f}, thinnest {prof.matmul[-1]['tflops']:.3f})"
          + (f"; layer efficiency {prof.layer_efficiency}" if prof.accelerator == "cuda" else ""))
    if prof.visit_overhead_us:
        print(f"the engine's own work per layer visit and micro-batch, beyond the modelled compute: {prof.visit_overhead_us / 1e3:.2f} ms")
    if prof.busy:
        print(f"mtc: warning: {prof.busy}", file=sys.stderr)
    print(f"profile written to {out}; use it with `mtc plan ... --machine {out}`")
    return 0


def _cmd_compile_user_model(a: argparse.Namespace, said: str = "") -> int:
    from mtc.api import compile as compile_model
    from mtc.errors import ConfigError

    if a.factory is not None and a.model is not None:
        raise ConfigError(f"give the model once: the preset {a.model!r} or --model {a.factory}, not both")
    res = compile_model(a.factory or a.model, a.output, batch_size=a.micro_batch_size, seq_len=a.seq_len, dtype=a.dtype,
                        matmul_fusion=a.matmul_fusion)
    if said:
        print(said)
    print(res.report)
    print(f"plan and kernels written to {res.path} (train it: mtc train --plan {res.path} --store RUN --data FILE)")
    return 0


def _cmd_eval(a: argparse.Namespace) -> int:
    from mtc.evaluate import evaluate_store

    r = evaluate_store(a.store, a.data, step=a.step, batches=a.batches, split=a.split, seed=a.seed, device=a.device)
    print(f"step {r.step}: {r.split} loss {r.loss:.6f} perplexity {r.perplexity:.6g} "
          f"({r.batches} batches, {r.tokens:,} tokens" + (f", {r.targets:,} of them loss targets" if r.targets != r.tokens else "")
          + f", {r.seconds:.2f} s)")
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    from mtc.config import SEED_MAX
    from mtc.errors import ConfigError
    from mtc.generate import generate_from_store

    a.top_k = a.top_k or None  # 0: no top-k cut (the settings are checked in generate_from_store)
    if not 0 <= a.seed <= SEED_MAX:  # the range torch's generators take (as `mtc train --seed`)
        raise ConfigError(f"--seed must be an integer from 0 to {SEED_MAX}, got {a.seed}")
    if a.weights_budget_gb is not None and not (math.isfinite(a.weights_budget_gb) and a.weights_budget_gb >= 0):
        # (checked here: nan and inf cannot become the byte count generate_from_store takes)
        raise ConfigError(f"--weights-budget-gb must be a finite number of GB >= 0 (0: stream every layer), "
                          f"got {a.weights_budget_gb:g}")
    budget = int(a.weights_budget_gb * 2**30) if a.weights_budget_gb is not None else None
    r = generate_from_store(a.store, a.prompt, step=a.step, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_k=a.top_k, seed=a.seed, context=a.context, kv_cache=not a.no_kv_cache,
                            tokenizer=a.tokenizer, device=a.device, device_budget_bytes=budget, stop=a.stop)
    print(a.prompt + r.text)
    if r.prompt_dropped:
        print(f"note: the prompt's first {r.prompt_dropped} of {r.prompt_tokens} tokens do not fit the context "
              f"({r.context} tokens) and were left out", file=sys.stderr)
    print(f"generated {len(r.tokens)} tokens from step {r.step} in {r.prefill_s + r.decode_s:.2f} s: "
          f"{r.tokens_per_s:.1f} tokens/s ("
          + (f"{r.decode_tokens_per_s:.1f} after the first; " if len(r.tokens) > 1 else "")
          + f"prompt {r.prompt_tokens} tokens, "
          f"{r.prefill_s:.2f} s to the first token; KV cache {'on' if r.kv_cache else 'off'}; "
          f"{r.resident_layers} layers resident, {r.streamed_layers} streamed per token)", file=sys.stderr)
    return 0


def _cmd_plot(a: argparse.Namespace) -> int:
    from mtc.plot import plot_run

    out = plot_run(a.store, a.output)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mtc`."""
    from mtc.config import field_help, field_metavar
    from mtc.models import preset_names

    p = argparse.ArgumentParser(prog="mtc", description="Train language models larger than GPU memory, streamed from a store.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="train the tiny model on the embedded corpus and print a sample")
    d.add_argument("--steps", type=int, default=400)
    d.add_argument("--dir", default="runs/demo", help="work directory (default: runs/demo)")
    d.set_defaults(fn=_cmd_demo)

    t = sub.add_parser("train", help="train a preset or a config file, resuming from the store if it has a commit",
                       description="Flags override the config file (or the preset's defaults); every value is checked "
                       "like a config file's.")
    # none of them: the model of the store's run (e.g. one made by `mtc import`) or of --init-from
    src = t.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"model preset, one of: {', '.join(preset_names())}")
    src.add_argument("--config", help="a .json or .toml TrainConfig file")
    src.add_argument("--plan", help="a plan directory from `mtc compile` or mtc.save_plan (its program and kernels are used as "
                     "compiled; a user's model needs a recorded factory to start, none to resume)")
    src.add_argument("--model", help="a model factory by import path, package.module:function (returns an nn.Module; "
                     "the current directory is searched first)")
    t.add_argument("--store", required=True, help="store directory (created, or resumed)")
    t.add_argument("--data", required=True, help="token file (.bin with its .json header), see `mtc prepare`")
    for path in _TRAIN_FLAGS:
        if path in _BOOL_FLAGS:
            t.add_argument(_flag(path), action=argparse.BooleanOptionalAction, dest=_dest(path), help=field_help(path))
        else:
            # Values stay text here: the schema parses and checks them, so a bad value is one line.
            aliases = ["--ram-budget"] if path == "ram_budget_gb" else []  # the name the disk-tier docs use
            t.add_argument(_flag(path), *aliases, dest=_dest(path), metavar=field_metavar(path), help=field_help(path))
    t.add_argument("--unfused", action="store_const", const="unfused", dest="kernels", help="same as --kernels unfused")
    t.add_argument("--stop-after", type=int, metavar="STEP",
                   help="stop once this step is committed (resume later); >= 1 (default: train to --steps)")
    t.add_argument("--overwrite", action="store_true", help="start over even if the store has a commit")
    t.add_argument("--init-from", metavar="RUN|HF_DIR", help="start a new run from the weights of a run's store or a "
                   "Hugging Face checkpoint directory, with fresh optimizer state (the model comes from there)")
    t.add_argument("--allow-change", metavar="FIELDS", help="on resume, let these differ from the committed run, e.g. "
                   "'steps,optim.lr' or 'data' (recorded in the commit history); model and shape fields never may")
    t.add_argument("--tensorboard", metavar="DIR", help="also write each step's figures as TensorBoard events into DIR "
                   "(needs the tensorboard package)")
    t.set_defaults(fn=_cmd_train)

    ev = sub.add_parser("eval", help="loss and perplexity of a run's committed weights on a token file (read-only)")
    ev.add_argument("store")
    ev.add_argument("--data", required=True, help="token file (see `mtc prepare`)")
    ev.add_argument("--step", type=int, help="committed step to evaluate (default: the last commit)")
    ev.add_argument("--batches", type=int, help="batches of the run's micro_batch_size x seq_len (default: the run's "
                    "eval_batches, so the val loss is the one --eval-every logged)")
    ev.add_argument("--split", default="val", choices=["val", "train", "all"],
                    help="val: the held-out last 5%% of the tokens (what --eval-every measures); all: the whole file")
    ev.add_argument("--seed", type=int, help="seed of the batch positions (default: the run's)")
    ev.add_argument("--device", help="cpu or cuda[:N] (default: the run's device when available, else cpu)")
    ev.set_defaults(fn=_cmd_eval)

    g = sub.add_parser("generate", help="sample text from a run's committed weights (layers streamed, KV cache)")
    g.add_argument("store")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--stop", action="append", default=[], metavar="TOKEN",
                   help="also stop at this token (repeatable; one token of the run's tokenizer); generation always stops "
                        "at its EOS and at chat end-of-turn markers it has (<|im_end|>, <|eot_id|>, ...)")
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens (default: 40; 0: the whole vocabulary)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--step", type=int, help="committed step to sample from (default: the last commit)")
    g.add_argument("--context", type=int, help="tokens the model sees (default: the prompt and the continuation, at least the run's seq_len; at most max_seq_len)")
    g.add_argument("--tokenizer", help="tokenizer.json or Hugging Face tokenizer directory (default: the run's)")
    g.add_argument("--device", help="cpu or cuda[:N] (default: the run's device when available, else cpu)")
    g.add_argument("--weights-budget-gb", type=float, help="device memory for resident weights; the rest is read "
                   "per token (default: free memory less 2 GiB; CPU: half the available RAM)")
    g.add_argument("--no-kv-cache", action="store_true", help="re-run the whole window for every token (slow; a check)")
    g.set_defaults(fn=_cmd_generate)

    pl = sub.add_parser("plot", help="draw a run's loss, validation loss, learning rate and throughput against step")
    pl.add_argument("store")
    pl.add_argument("-o", "--output", required=True, help="file to write: PNG, or PDF / SVG by its suffix")
    pl.set_defaults(fn=_cmd_plot)

    i = sub.add_parser("inspect", help="list a store's arrays, its last commit and any damage (read-only; exit 1 if damaged)")
    i.add_argument("store")
    i.add_argument("--arrays", action="store_true", help="list every array")
    i.add_argument("--verify", action="store_true", help="also check every chunk of the committed state (as `mtc verify`)")
    i.set_defaults(fn=_cmd_inspect)

    v = sub.add_parser("verify", help="check a store's metadata, commit files and committed chunks (read-only; exit 1 if damaged)")
    v.add_argument("store")
    v.set_defaults(fn=_cmd_verify)

    r = sub.add_parser("repair", help="restore a missing or garbled commit.json from the store's commit history, or roll "
                       "back to the newest earlier commit whose state is whole when the last one's is damaged")
    r.add_argument("store")
    r.set_defaults(fn=_cmd_repair)

    pr = sub.add_parser("prepare", help="tokenize text, JSONL or parquet (or SFT records) into a token file",
                        description="Each text file, JSONL line or parquet row is one document, followed by the "
                        "tokenizer's EOS token; SFT records (--prompt-field/--response-field or --messages-field) get "
                        "a loss mask so only the responses are trained on.")
    pr.add_argument("inputs", nargs="+", metavar="INPUT", help="files, or directories of *.txt / *.jsonl / *.parquet (read at any depth)")
    pr.add_argument("-o", "--output", required=True, help="the token file to write (OUT.bin, with OUT.json beside it)")
    pr.add_argument("--tokenizer", default="byte", help="'byte' (default), a tokenizer.json, or a Hugging Face "
                    "tokenizer directory; its files are copied to OUT.tokenizer/")
    pr.add_argument("--format", choices=["text", "jsonl", "parquet"], help="input format (default: by file suffix)")
    pr.add_argument("--field", default="text", help="the text field of JSONL / parquet records (default: text)")
    pr.add_argument("--prompt-field", help="SFT: the prompt field (with --response-field); not trained on")
    pr.add_argument("--response-field", help="SFT: the response field, the only targets of the loss")
    pr.add_argument("--messages-field", help="SFT: a field of chat messages [{role, content}, ...]; the assistant's "
                    "replies are the targets (rendered with the tokenizer's chat template when it has one)")
    pr.add_argument("--eos", metavar="TOKEN", help="the token ending each document, when tokenizer_config.json names none")
    pr.add_argument("--skip-bad-records", action="store_true", help="skip records that cannot be used (a line that is "
                    "not JSON, a missing or null field, a chat with no assistant reply) and count them in the summary "
                    "and the token file's header, instead of stopping at the first")
    pr.set_defaults(fn=_cmd_prepare)

    c = sub.add_parser("compile", help="trace a model and generate its fused kernels into a plan directory; print the report")
    c.add_argument("model", nargs="?", help="model preset")
    c.add_argument("--model", dest="factory", metavar="PACKAGE.MODULE:FACTORY",
                   help="a user's model: a function (or nn.Module class) by import path that returns the model")
    c.add_argument("-o", "--output", required=True, help="plan directory to write (program, kernels, report)")
    c.add_argument("--seq-len", type=int, default=128, help="tokens per sequence the plan is traced for (default 128, "
                   "as mtc train's; a plan's shapes are static: train it at these)")
    c.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch the plan is traced for "
                   "(default 16, as mtc train's)")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the plan's compute dtype; auto: bfloat16 where CUDA is available (as `mtc train` computes "
                        "there by default), float32 otherwise")
    c.add_argument("--matmul-fusion", default="auto", choices=["auto", "on", "off"],
                   help="fuse norms / activations / residual adds into matmuls: auto (where faster, timed per shape on "
                   "CUDA; never on the CPU), on, off")
    c.set_defaults(fn=_cmd_compile)

    im = sub.add_parser("import", help="import a Hugging Face checkpoint (Llama, Mistral, Qwen2, GPT-2) into a new store, streamed")
    im.add_argument("hf_dir", help="directory with config.json and safetensors weights (sharded or not)")
    im.add_argument("--store", required=True, help="the new store directory")
    im.add_argument("--overwrite", action="store_true", help="replace an mtc store already there")
    im.set_defaults(fn=_cmd_import)

    rs = sub.add_parser("reshard", help="rewrite a data-parallel run's state for another world size (bit-identical, one new commit)")
    rs.add_argument("store", help="the run directory")
    rs.add_argument("--world-size", type=int, required=True, help="ranks of the next launch (1: the single-process layout)")
    rs.add_argument("--rank-dir", metavar="TEMPLATE", help="where the new shard stores go, e.g. /nvme/run/rank-{rank}-of-{world_size} "
                    "(placeholders {rank}, {world_size}; default: RUN/ranks/); every current shard must be visible here")
    rs.set_defaults(fn=_cmd_reshard)
    ex = sub.add_parser("export", help="write a run's weights as a Hugging Face checkpoint directory, streamed")
    ex.add_argument("run", help="store directory of the run")
    ex.add_argument("-o", "--output", required=True, help="output directory (new, or empty)")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights (default: float32)")
    ex.add_argument("--step", type=int, help="a committed step the store still holds (default: the last)")
    ex.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB (default: 5GB)")
    ex.add_argument("--tokenizer", help="tokenizer.json or directory to export when the run has no tokenizer files")
    ex.set_defaults(fn=_cmd_export)

    tr = sub.add_parser("trace", help="trace a preset into a plan directory")
    tr.add_argument("preset")
    tr.add_argument("-o", "--output", required=True, help="plan directory to write (program and model record)")
    tr.add_argument("--seq-len", type=int, default=128, help="tokens per sequence to trace for (default 128, as mtc train's)")
    tr.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch to trace for "
                    "(default 16, as mtc train's)")
    tr.add_argument("--meta", action="store_true", help="trace on the meta device (no weights; for large presets)")
    tr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the plan's compute dtype; auto: bfloat16 where CUDA is available, float32 otherwise")
    tr.set_defaults(fn=_cmd_trace)

    pl = sub.add_parser("plan", help="placement, memory per tier, disk per durability mode, fit and predicted step time of a run "
                        "on a machine profile; exit 1 if it does not fit")
    pl.add_argument("target", nargs="?", help="a model preset or a plan directory (from `mtc compile`)")
    pl.add_argument("--config", help="a .json or .toml TrainConfig file instead")
    pl.add_argument("--machine", "--profile", dest="machine", help="a profile .json from `mtc calibrate`, or a built-in machine "
                    "(h100-box, h200-1.5tb, 256gb-4tb-nvme, 8x-h100); default: the last `mtc calibrate` profile, else this machine, measured now and saved")
    for path in _PLAN_FLAGS:
        if path in _BOOL_FLAGS:
            pl.add_argument(_flag(path), action=argparse.BooleanOptionalAction, dest=_dest(path), help=field_help(path))
        else:
            pl.add_argument(_flag(path), dest=_dest(path), metavar=field_metavar(path), help=field_help(path))
    pl.add_argument("--no-extrapolate", action="store_true", help="skip the 70B/120B/175B extrapolations and the largest-model search")
    pl.add_argument("--world-size", type=int, default=1, metavar="N",
                    help="plan one rank of a data-parallel run of N ranks (torchrun --nproc-per-node), its host's totals and "
                         "the scaling at 1, 2, 4, 8 ranks (default 1: the single-process plan)")
    pl.add_argument("--nodes", type=int, default=1, metavar="K", help="hosts the N ranks are spread over (default 1)")
    pl.add_argument("--dp-model", choices=["engine", "host", "design"], default="engine",
                    help="with --world-size: model the data-parallel engine as built (default: NCCL collectives on the GPUs, "
                         "gpu, ram and disk tiers, a store per rank), with --dp-collectives host (gloo in host memory, ram and "
                         "disk tiers), or issue 13's whole design (every tier)")
    pl.set_defaults(fn=_cmd_plan)

    ca = sub.add_parser("calibrate", help="measure this machine (copies, disk, CPU AdamW, matmul; ~10-30 s) into a profile for `mtc plan`")
    ca.add_argument("-o", "--output", help="profile file (default: ~/.cache/mtc/machine.json, which `mtc plan` reads by default)")
    ca.add_argument("--dir", help="directory on the disk to measure (where stores will live; default: the temp dir)")
    ca.set_defaults(fn=_cmd_calibrate)
    return p


def _run(argv: list[str] | None) -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    # (restored on the way out: `_last_words` ignores both, and a caller's own handlers, e.g. a
    # test harness's, are theirs again)
    before = [(signal.SIGINT, signal.getsignal(signal.SIGINT)), (signal.SIGTERM, signal.signal(signal.SIGTERM, _on_sigterm))] \
        if main_thread else []
    try:
        try:
            # (inside: the parser imports torch, seconds in which a Ctrl-C is as likely as later)
            args = build_parser().parse_args(argv)
            return args.fn(args)
        except MTCError as e:
            # (a fit refusal names every resource that is short, one line each)
            return _last_words([f"mtc: error: {line}" for line in str(e).splitlines() or [""]], 2, main_thread)
        except KeyboardInterrupt:
            return _last_words(["mtc: interrupted"], 130, main_thread)
        except _Terminated:
            return _last_words(["mtc: terminated (SIGTERM)"], 143, main_thread)
    finally:
        for sig, handler in before:
            if handler is not None:  # (None: not set from Python; nothing to put back)
                signal.signal(sig, handler)
        # Flush here, not at interpreter exit, so a reader that closed the pipe surfaces in main.
        sys.stdout.flush()


def _last_words(lines: list[str], code: int, main_thread: bool) -> int:
    """Print why the command ended on stderr and return its exit ``code``, SIGTERM and Ctrl-C
    ignored from here on (`_run` restores the handlers it found): torchrun terminates the other
    ranks when one fails, and a SIGTERM raised inside the handler that reported a lost peer
    escaped it as a traceback in place of the line."""
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    for line in lines:
        print(line, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: run a subcommand; an MTCError prints one line and exits 2, an interruption 130
    (SIGTERM 143)."""
    try:
        code = _run(argv)
        _forget_handled_interrupt()
        return code
    except BrokenPipeError:
        # `mtc inspect ... | head` closed our stdout. Python's docs (signal module, "Note on SIGPIPE"):
        # point stdout at devnull so the final flush at exit cannot raise again, and exit 1.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout has no file descriptor (captured in tests): nothing to flush
            pass
        return 1


def _forget_handled_interrupt() -> None:
    """Clear CPython's record of a KeyboardInterrupt that ended a string ``exec``.

    CPython notes a KeyboardInterrupt leaving code that ``exec`` ran from a string (a dataclass's
    generated methods, made while a module is imported lazily during set-up) as unhandled, even
    though the CLI caught it, and a ``python -m mtc`` (torchrun's launch) then ends by killing
    itself with SIGINT after "mtc: interrupted" instead of exiting 130. The next string ``exec``
    resets that record: this one, which raises nothing, leaves it clear.
    """
    exec("None")  # noqa: S102


if __name__ == "__main__":
    sys.exit(main())
