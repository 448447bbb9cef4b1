#!/usr/bin/env bash
# Everything the GPU checks of the compiler need, in one device run (under 10 minutes on an H100):
# install mtc offline, run the gpu-marked tests (6 workers: most of their time is Triton
# compiling), then bench_fusion for each architecture and part in its own process, most important
# first, each under a time limit so one slow part cannot eat the rest. Prepare the wheels first on
# the CPU machine with ../shared/tools/device-wheels.sh and carry ".whl". Logs and a tarball of
# the JSON records land in $OUT (or bench/results/ without it).
#   bash bench/gpu_session.sh [PARTS...]     PARTS like llama/block qwen2/head (default: all six)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
out=${OUT:-bench/results}
mkdir -p "$out"
log="$out/gpu_session.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$log"
start=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -m gpu -n 6 -p no:benchmark --durations=8 tests 2>&1 | tail -30 | tee -a "$log"
fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(llama/block llama/head qwen2/block gpt2/block qwen2/head gpt2/head)
budget=${BENCH_BUDGET_S:-520}
for p in "${parts[@]}"; do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 40 ]; then echo "skipped $p: out of time" | tee -a "$log"; continue; fi
  timeout "$left" python3 bench/bench_fusion.py --arch "${p%/*}" --part "${p#*/}" ${BENCH_ARGS:-} 2>&1 | tee -a "$log"
done
tar -czf "$out/records.tgz" -C bench/results $(cd bench/results && ls -t bench_fusion-[!s]*.json 2>/dev/null | head -20) 2>/dev/null
exit 0
