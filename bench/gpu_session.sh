#!/usr/bin/env bash
# Everything the GPU checks need, in one device run (under 10 minutes on an H100): install mtc
# offline, then each part named, most important first, each in its own process under what is left
# of the time budget (BENCH_BUDGET_S, default 550 s) so one slow part cannot eat the rest:
#   tests          the gpu-marked tests (6 workers: most of their time is Triton compiling; at most
#                  TESTS_S, default 200 s), then those also marked `alone` (they time the GPU) by
#                  themselves; the whole pytest output lands in $OUT/gpu_tests.log
#   ARCH/PART      bench_fusion, e.g. llama/block qwen2/head, profiled (each variant's kernels over one
#                  more call, and the compute floor they give: how far fusion can take the part at most)
#   siblings       bench_sibling_matmuls: q/k/v and gate/up projections as one matmul each against
#                  separate ones (Llama-8B and Qwen2 blocks, P1, P3 shapes; ~20 s; measured on the H200,
#                  2026-11-27: 0.04-0.06 ms saved with the cat, no merge pass built)
#   model/SHAPE    bench_fusion's whole-model line: SHAPE 1.5b or 4.6b (bench_train's P3 / P1), the full
#                  stack's step through the executor, unfused vs mtc fused vs replayed vs torch.compile
#   fusion         bench_fusion's three blocks (llama, qwen2, gpt2) in one process: unfused, mtc fused
#                  (matmul prologue/epilogue fusion chosen per shape), fusion forced on / off, torch.compile
#   train/PART     bench_train, e.g. train/P1-16 train/P1-48 train/P3 train/P5 (each up to 8 minutes;
#                  P1-16 runs stateless and auto (P1_AB=1 adds stateless-nohandoff between them:
#                  update_handoff's A/B, ~60 s more; the H200 at 1b43958: 1.775 s/step with,
#                  1.978 without);
#                  it starts only with TRAIN_MIN_S, default 150 s, left, and stops starting settings
#                  at its own limit, keeping the ones it finished; P3 runs mtc auto and the
#                  torch.compile baselines first, so a short budget still gives the ratio)
#                  (train, dp and disk parts first run `mtc calibrate` once per machine: its profile
#                  picks the GPU-updated layers and predicts the step; a copy lands in $OUT/machine.json)
#   dp             bench_train --world-size 1: the plain run vs torchrun at one rank (issue 13's 2 %
#                  bound), interleaved rounds, P3's shape; not in the defaults
#   disk[/SHAPE]   bench_disk_tier: all state on disk, raw vs store GB/s, host RAM per parameter
#                  (SHAPE 2.3b fits a 64 GB disk's two generations; default 4.6b); not in the defaults
# Prepare the wheels first on the CPU machine with ../shared/tools/device-wheels.sh and carry
# ".whl". Check there too that every generated kernel compiles for sm_90 with the box's Triton
# (bench/kernel_compile_check.py, ~40 s; its docstring makes the Triton 3.6 venv): a kernel the
# interpreter runs and the GPU compiler rejects would otherwise cost the session. Logs and a tarball of this call's JSON records (rewritten after each part) land in $OUT
# (or bench/results/ without it): four files. Last, bench/session_summary.py prints every part's table and
# verdict again from this call's records, so the reply's tail (its last 12,000 characters) holds them all. Add nothing else to $OUT in the same call: the device
# tool brings back at most 8 files, and with more it brings back none (2026-11-27: a trailing
# `cp bench/results/*.json $OUT/` lost a whole call's records; the next call's fresh copy of the
# tree no longer had them either).
#
# A lent task has 15 minutes of device time in all (the machine's start, 1-2 minutes, included; a
# machine idle for 30 s goes back, and a fresh start costs minutes again). So, two calls back to back:
#   call 1, timeout_s 600:  bash bench/gpu_session.sh
#       (the default list, in order of what is pending: tests, train/P1-16, train/P1-48; a part that
#       no longer fits is skipped and says so; on the H200, 2026-11-27 21:52, tests + P1-16 with
#       P1_AB=1 + fusion took 528 s)
#   call 2, at once (the machine still warm; `status` says the device time left), timeout_s = that
#       less 30, BENCH_BUDGET_S = the timeout less 40 (install, and the last part's records):
#       bash bench/gpu_session.sh PARTS   with PARTS: what call 1 skipped of the defaults, then
#       train/P3 (goal met on 2026-11-27 at 1.26x; its stateless steps alternated too), then fusion
#       (issue 9's blocks, unchanged since 1b43958 but for 30 timed rounds, not 10: ~15 s more, and the
#       per-round ratios beside the verdict), model/1.5b (no goal), train/P5 (met 2026-11-26);
#       P1_AB=1 adds the handoff's A/B to P1-16 (measured 2026-11-27: 1.775 s with, 1.978 without)
#   (the first H100 session, 2026-11-26, took: install + tests 90 s, calibrate 20 s, P1-16 142 s,
#   P1-48 142 s, llama/block 35 s, P3 110 s, fusion 80 s; the machine's start about 30 s; since
#   2026-11-27 P3 adds auto-recompute and a torch.compile baseline without checkpointing, ~45 s
#   more, and model/ two variants after torch.compile, mtc_fused_saved and mtc_fused_saved_graph;
#   the H200 on 2026-11-27: gpu tests 57 s at 6 workers; since 3af4c08 every plan compiled on
#   CUDA times its column and rowcol kernels' launch configurations (2-4 more Triton compiles per
#   kernel, ~0.7 s each: fusion and model/ may take a minute or two longer, their records' compile_s
#   say how much)
#   bash bench/gpu_session.sh [PARTS...]     default: tests train/P1-16 fusion train/P3
#   bash bench/gpu_session.sh train/P1-16    just that (no tests); SKIP_TESTS=1 drops tests from any list
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/mtc-pip.log 2>&1 \
  || { echo "installing mtc failed:"; cat /tmp/mtc-pip.log; exit 1; }
out=${OUT:-bench/results}
mkdir -p "$out"
log="$out/gpu_session.log"
since=$(mktemp)  # records newer than this file are this call's
# after every part, and on the way out (the device's time limit sends TERM first): a call cut off
# still returns what finished, a killed part's records written so far included
pack() {
  local files
  files=$(cd bench/results && find . -maxdepth 1 -name '*.json' -newer "$since" -printf '%f\n' | sort)
  [ -n "$files" ] && tar -czf "$out/records.tgz" -C bench/results $files
  return 0
}
# last of all, this call's tables and verdicts again from its records (bench/session_summary.py): the
# reply keeps only the output's last 12,000 characters, and its files may not come back
summary() {
  local tl=()
  [ -f "$out/gpu_tests.log" ] && tl=(--tests-log "$out/gpu_tests.log")
  timeout -k 2 "${1:-60}" python3 bench/session_summary.py --newer "$since" "${tl[@]}" 2>&1 | tee -a "$log"
  return 0
}
trap pack EXIT
trap 'pack; summary 10; exit 143' TERM
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$log"
start=$(date +%s)
parts=("$@")
# default: what is pending, most important first: the gpu tests (the copies back now waited for on
# their own thread, 951d3cc), P1-16 stateless and auto (the next step's loads no longer wait for the
# last step's whole state: its steps alternated 0.93 / 2.62 s on the H200 at 1b43958, 256.1 TFLOP/s,
# `mtc plan` predicts 1.09 s), P1-48 (goal 300; last measured on 2026-11-26, before the handoff);
# see the header for call 2
[ ${#parts[@]} -eq 0 ] && parts=(tests train/P1-16 train/P1-48)
budget=${BENCH_BUDGET_S:-550}
profile="$HOME/.cache/mtc/machine.json"
train_min=${TRAIN_MIN_S:-150}
for p in "${parts[@]}"; do
  left=$(( budget - ($(date +%s) - start) ))
  case "$p" in
    train/*|dp|disk*)
      # the box measured once (~20 s): GPU-updated layers chosen on its rates rather than the
      # defaults, `pred s` from its own profile; the profile comes back for planning on the CPU
      # (only for a part that will run: with less than its minimum left it is skipped below)
      if [ ! -f "$profile" ] && [ "$left" -ge "$train_min" ]; then
        timeout -k 5 $(( left < 120 ? left : 120 )) python3 -m mtc calibrate 2>&1 | tail -12 | tee -a "$log"
        [ -f "$profile" ] && cp "$profile" "$out/machine.json"
        left=$(( budget - ($(date +%s) - start) ))
      fi ;;
  esac
  case "$p" in
    tests)
      if [ -n "${SKIP_TESTS:-}" ]; then echo "skipped tests: SKIP_TESTS" | tee -a "$log"; continue; fi
      if [ "$left" -lt 60 ]; then echo "skipped tests: out of time" | tee -a "$log"; continue; fi
      cap=${TESTS_S:-200}  # 56 gpu tests now (engine, graph replay, fused variants, pinned memory, NCCL)
      # the whole output in its own file: a line per test as it ends (-v: a run cut at the cap still
      # says which passed and failed), then every failure's traceback; its tail in the log and the reply
      # then the `alone` ones by themselves: they time the GPU, which the other workers' kernels share
      # (same log; each run ends with its own closing line, which session_summary.py prints)
      t0=$(date +%s)
      timeout -k 10 $(( left < cap ? left : cap )) python3 -m pytest -v -m "gpu and not alone" -n 6 -p no:benchmark --durations=8 -rfE tests \
        > "$out/gpu_tests.log" 2>&1
      echo "gpu tests: pytest exit $? (124: cut at TESTS_S)" | tee -a "$log"
      cap=$(( cap - ($(date +%s) - t0) )); left=$(( budget - ($(date +%s) - start) ))
      if [ "$cap" -ge 20 ] && [ "$left" -ge 30 ]; then
        timeout -k 10 $(( left < cap ? left : cap )) python3 -m pytest -v -m "gpu and alone" -p no:benchmark -rfE tests \
          >> "$out/gpu_tests.log" 2>&1
        echo "gpu tests that time the GPU, by themselves: pytest exit $? (124: cut at TESTS_S)" | tee -a "$log"
      else
        echo "skipped the gpu tests that time the GPU: out of time" | tee -a "$log"
      fi
      tail -40 "$out/gpu_tests.log" | tee -a "$log" ;;
    disk|disk/*)
      if [ "$left" -lt "$train_min" ]; then echo "skipped $p: out of time ($left s left)" | tee -a "$log"; continue; fi
      shape=${p#disk}; shape=${shape#/}
      limit=$(( left - 20 < 480 ? left - 20 : 480 ))
      timeout -k 10 "$left" python3 bench/bench_disk_tier.py ${shape:+--shape "$shape"} --time-limit-s "$limit" ${DISK_ARGS:-} 2>&1 \
        | tee -a "$log" ;;
    train/*)
      if [ "$left" -lt "$train_min" ]; then echo "skipped $p: out of time ($left s left)" | tee -a "$log"; continue; fi
      # bench_train stops starting settings at its own limit and writes its records; timeout is the backstop
      limit=$(( left - 20 < 480 ? left - 20 : 480 ))
      # one plans directory for every train part of the call: a shape's plan compiles once (P1-48 loads P1-16's)
      # P1_AB=1: P1-16 adds the weights handoff's A/B between its two settings (stateless-nohandoff:
      # every visit reads the host copy, as before 2026-11-27; TRAIN_ARGS may name --settings itself,
      # e.g. stateless-noprefetch for the prefetch's); off by default: a lent task's 15 device
      # minutes fit the tests, P1-16, the 1.5B stack and P3 only without it
      ab=()
      [ "$p" = train/P1-16 ] && [ -n "${P1_AB:-}" ] && [[ "${TRAIN_ARGS:-}" != *--settings* ]] && ab=(--settings stateless,stateless-nohandoff,auto)
      # P3: the saved activations' A/B (auto keeps every block's matmul and attention outputs on the
      # GPU, auto-recompute recomputes them) first, then stateless; its baselines add torch.compile
      # without checkpointing (about 40 s more than before)
      [ "$p" = train/P3 ] && [[ "${TRAIN_ARGS:-}" != *--settings* ]] && ab=(--settings auto,auto-recompute,stateless)
      timeout -k 10 "$left" python3 bench/bench_train.py --only "${p#train/}" --time-limit-s "$limit" --plans /tmp/mtc-bench-plans \
        "${ab[@]}" ${TRAIN_ARGS:-} 2>&1 | tee -a "$log" ;;
    dp)
      if [ "$left" -lt "$train_min" ]; then echo "skipped $p: out of time ($left s left)" | tee -a "$log"; continue; fi
      limit=$(( left - 20 < 480 ? left - 20 : 480 ))
      timeout -k 10 "$left" python3 bench/bench_train.py --world-size 1 --repeats "${DP_REPEATS:-3}" --time-limit-s "$limit" \
        ${TRAIN_ARGS:-} 2>&1 | tee -a "$log" ;;
    model/*)
      if [ "$left" -lt 180 ]; then echo "skipped $p: out of time ($left s left)" | tee -a "$log"; continue; fi
      # --profile: each variant's kernels over one more step (where P3's 0.86x of torch.compile goes)
      timeout -k 10 "$left" python3 bench/bench_fusion.py --arch llama --part model --shape "${p#model/}" \
        --time-limit-s $(( left - 150 )) --profile ${BENCH_ARGS:-} 2>&1 \
        | tee -a "$log" ;;
    fusion)
      if [ "$left" -lt 120 ]; then echo "skipped $p: out of time" | tee -a "$log"; continue; fi
      # --profile: each variant's top kernels (torch.compile's too) go into the records: the gap to
      # torch.compile (2-4 % on the first H100 run) is read off them
      timeout -k 10 "$left" python3 bench/bench_fusion.py --arch llama qwen2 gpt2 --part block --profile ${BENCH_ARGS:-} 2>&1 \
        | tee -a "$log" ;;
    siblings)
      # q/k/v and gate/up as one matmul each, separate vs merged, on the blocks' and P1/P3's shapes (~20 s):
      # whether the compiler pass is worth building (bench/bench_sibling_matmuls.py's docstring)
      if [ "$left" -lt 40 ]; then echo "skipped $p: out of time" | tee -a "$log"; continue; fi
      timeout -k 10 "$left" python3 bench/bench_sibling_matmuls.py 2>&1 | tee -a "$log" ;;
    *)
      if [ "$left" -lt 40 ]; then echo "skipped $p: out of time" | tee -a "$log"; continue; fi
      timeout -k 10 "$left" python3 bench/bench_fusion.py --arch "${p%/*}" --part "${p#*/}" --profile ${BENCH_ARGS:-} 2>&1 | tee -a "$log" ;;
  esac
  pack
done
summary
exit 0
