"""A full disk in the middle of training: one clear error, the last commit intact, and a resume
after freeing space ends bit-identically to an unbroken run."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from mtc.errors import StoreError
from mtc.runtime.state import read_params
from mtc.store import TensorStore
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_mid_run_keeps_the_last_commit_and_resumes(tmp_path):
    tokens = skewed_tokens(tmp_path / "tok.bin")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        cfg = small_config(steps=6, commit_every=1)
        ref = train(cfg, tmp_path / "ref", tokens)
        ref_w = read_params(ref.program, ref.store, ref.generation)
        ref.store.close()

        def fill(rec):  # after step 2 the disk fills up: step 3's write-behind cannot land
            if rec.step == 2:
                with open(mnt / "filler", "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC

        with pytest.raises(StoreError, match="(?i)no space left"):
            train(cfg, mnt / "s", tokens, on_step=fill)
        with TensorStore.open(mnt / "s", read_only=True) as st:
            last = st.last_commit().step  # step 2's commit may or may not have landed before the disk filled
            assert last in (1, 2)
        (mnt / "filler").unlink()
        res = train(cfg, mnt / "s", tokens)
        try:
            got = read_params(res.program, res.store, res.generation)
            assert res.start_step == last and all(torch.equal(got[k], ref_w[k]) for k in ref_w)
        finally:
            res.store.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
