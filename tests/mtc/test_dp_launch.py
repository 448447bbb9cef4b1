"""Data-parallel launches that cannot form one run: a rank started with other flags than rank 0's,
and a rank whose peers never join. Each stops every rank with one line before any shard is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtc.dist import PER_HOST_FIELDS
from tests.mtc.test_data_parallel import ROOT, _config, _env, _free_port, _train_args
from tests.runtime.engine_util import skewed_tokens


def _ranks(n: int, args: list[str], extra: dict[int, list[str]], started: int | None = None) -> list[subprocess.Popen]:
    """Ranks 0..started-1 of an ``n``-rank world, each with ``args`` and its own ``extra`` flags."""
    port, procs = _free_port(), []
    for r in range(n if started is None else started):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen([sys.executable, *args, *extra.get(r, [])], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _ends(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=300), p.stderr.read()) for p in procs]


@pytest.fixture
def launch(tmp_path):
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(_config(steps=1, grad_accum=2).to_dict()))
    return _train_args(cfg_file, tmp_path / "s", tokens.path) + ["--dist-timeout-s", "20"]


@pytest.mark.slow
def test_a_rank_with_other_flags_stops_every_rank_before_a_shard_is_written(launch, tmp_path):
    # rank 1 alone with another lr and durability had trained beside rank 0 (exit 0, other weights)
    # and left shards without moments that no resume or reshard could read
    ends = _ends(_ranks(2, launch, {1: ["--lr", "0.001", "--durability", "weights"]}))
    for code, err in ends:
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("mtc: error:")]
        assert code == 2 and len(lines) == 1, err[-3000:]
        assert ("rank 1's config differs from rank 0's: durability 'full' (rank 0) vs 'weights', optim.lr 0.003 (rank 0) "
                "vs 0.001" in lines[0]), lines[0]
    assert not (tmp_path / "s" / "commit.json").exists() and not (tmp_path / "s" / "ranks").exists()
    # the same command on every rank starts the run in that store; per-host fields may differ
    ends = _ends(_ranks(2, launch, {1: ["--io-threads", "2", "--optim-threads", "1"]}))
    assert all(code == 0 for code, _ in ends), [err[-2000:] for _, err in ends]
    assert json.loads((tmp_path / "s" / "commit.json").read_text())["step"] == 1


def test_the_per_host_fields_are_config_fields():
    from mtc.config import TrainConfig

    assert PER_HOST_FIELDS <= set(TrainConfig().to_dict())


@pytest.mark.slow
def test_a_rank_whose_peers_never_join_is_one_line(launch):
    # only rank 0 of 2 starts: torch's DistStoreError had ended it with ~40 lines of traceback
    ((code, err),) = _ends(_ranks(2, [*launch, "--dist-timeout-s", "3"], {}, started=1))
    assert code == 2 and err.strip().startswith("mtc: error: rank 0 of 2: the ranks did not all meet at 127.0.0.1:"), err
    assert "Traceback" not in err and "start the same command on every rank" in err, err


@pytest.mark.slow
def test_ranks_whose_auto_placements_differ_stop_with_rank_0s_placement(launch, tmp_path):
    # auto placement follows each host's RAM budget (a per-host field): rank 1's puts layers on disk
    ends = _ends(_ranks(2, [*launch, "--placement", "auto"], {1: ["--ram-budget-gb", "0.0001"]}))
    for code, err in ends:
        assert code == 2 and "rank 1 places the layers as disk:0-3, rank 0 as ram:0-3" in err, err[-3000:]
        assert "pass rank 0's placement as --placement ram:0-3 on every rank" in err, err
    assert not (tmp_path / "s" / "commit.json").exists() and not (tmp_path / "s" / "ranks").exists()
