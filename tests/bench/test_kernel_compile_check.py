"""bench/kernel_compile_check.py: generated kernels compile for sm_90 on a machine without a GPU.

Both run in a subprocess without TRITON_INTERPRET (the tests' interpreter replaces `triton.jit`'s
compiled functions, which the check intercepts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=BENCH.parent)


def test_a_kernel_the_gpu_compiler_rejects_is_reported_and_a_good_one_gives_its_resources(tmp_path: Path) -> None:
    script = tmp_path / "kernels.py"  # @triton.jit functions must live in a file
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(BENCH)!r})
        import torch, triton, triton.language as tl
        from kernel_compile_check import compiling_launches

        @triton.jit
        def fill(x, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x + offs, 1.0, mask=offs < n)

        got = []
        x = torch.empty(100, device="meta")
        with compiling_launches(90, got.append):
            fill[(1,)](x, 100, BLOCK=128, num_warps=4)
            fill[(1,)](x, 100, BLOCK=100)  # arange's range must be a power of 2: the compiler refuses
        print(json.dumps(got))
    """))
    r = _run([str(script)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    good, bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert good["kernel"] == "fill" and good["warps"] == 4 and good["constexprs"] == {"BLOCK": 128}
    assert good["REG"] > 0 and good["LOCAL"] == 0 and "error" not in good
    assert "error" in bad and "REG" not in bad and bad["constexprs"] == {"BLOCK": 100}


@pytest.mark.slow
def test_gpt2s_generated_kernels_compile_for_sm90_at_every_tuning_candidate() -> None:
    # GPT-2's block has every kernel mode (pointwise, row, rowcol, column) and the column combine
    r = _run([str(BENCH / "kernel_compile_check.py"), "--arch", "gpt2", "--seq", "128", "--no-record"], timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    last = r.stdout.strip().splitlines()[-1]
    assert " 0 failed, 0 spill registers" in last, last
    lines = r.stdout.splitlines()
    for where in ("gpt2/block/forward", "gpt2/block/joint", "gpt2/block/backward", "gpt2/head/joint"):
        assert any(line.startswith(where) for line in lines), where
    assert any("_combine_kernel" in line for line in lines)
    assert any('"BLOCK_M"' in line for line in lines)  # a column kernel, at its tuning candidates
    assert sum('"STAGES": 2' in line for line in lines) >= 2  # the pipelined candidates of rowcol and column kernels
    # cuDNN attention's per-query-head way: its KV repeat and gradient sum kernels (kernels/kv_groups.py)
    assert all(any(line.startswith("llama/attention/kv_groups") and k in line for line in lines)
               for k in ("_expand_heads_kernel", "_sum_groups_kernel")), lines[-6:]
