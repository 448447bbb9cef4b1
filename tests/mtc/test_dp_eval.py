"""`--eval-every` in a data-parallel run: each rank validates on its share of the eval batches.

Two ranks over gloo (launched directly with torchrun's environment), each with a spy
(`tests/mtc/dp_eval_rank.py`) that counts the batches the rank ran forward and computes, beside
the run's figure, the loss of all the eval batches on that rank alone with the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtc.evaluate import evaluate_store
from tests.mtc.test_data_parallel import ROOT, _config, _env, _free_port, _train_args
from tests.runtime.engine_util import skewed_tokens

SPY = "tests/mtc/dp_eval_rank.py"


def _run(d: Path, eval_batches: int, world: int = 2) -> list[list]:
    """A ``world``-rank run with a validation at every step; each rank's recorded validations."""
    tokens = skewed_tokens(d / "tok.bin")
    cfg_file = d / "run.json"
    cfg_file.write_text(json.dumps(_config(steps=2, grad_accum=2, eval_every=1, eval_batches=eval_batches).to_dict()))
    port, procs = _free_port(), []
    for r in range(world):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        args = [SPY, str(d / "evals"), *_train_args(cfg_file, d / "s", tokens.path)[2:]]  # (not -m mtc: the spy runs it)
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        err = p.communicate(timeout=400)[1]
        assert p.returncode == 0, err[-3000:]
    return [json.loads((d / f"evals.rank-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("eval_batches", [3, 1])  # uneven shares; one rank with none
def test_ranks_split_the_eval_batches_and_log_the_single_process_figure(tmp_path, eval_batches):
    evals = _run(tmp_path, eval_batches)
    steps = 2
    for r, mine in enumerate(evals):
        assert [e[0] for e in mine] == list(range(steps))
        # this rank's share only (it ran all of them on every rank before: N times the work)
        share = (r + 1) * eval_batches // 2 - r * eval_batches // 2
        assert [e[1] for e in mine] == [share] * steps, (r, mine)
        # bit for bit the figure of one process over all the batches with these weights
        assert [e[2] for e in mine] == [e[3] for e in mine]
    assert [e[2] for e in evals[0]] == [e[2] for e in evals[1]]  # every rank has the figure
    logged = [json.loads(ln)["val_loss"] for ln in (tmp_path / "s" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [e[2] for e in evals[0]]
    res = evaluate_store(tmp_path / "s", tmp_path / "tok.bin", batches=eval_batches)  # the committed last step, read back
    assert res.loss == pytest.approx(logged[-1], rel=1e-6, abs=1e-7)
