#!/usr/bin/env bash
# Everything the GPU checks of the compiler need, in one device run (about 10 minutes on an H100):
# install mtc offline, run the gpu-marked tests, then bench_fusion (Llama, Qwen2, GPT-2: block and
# head). Prepare the wheels first on the CPU machine with ../shared/tools/device-wheels.sh and carry
# ".whl"; records land in bench/results/ and, when $OUT is set, are copied there with the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
out=${OUT:-bench/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -40 | tee "$out/gpu_tests.log"
python3 bench/bench_fusion.py "$@" 2>&1 | tee "$out/bench_fusion.log"
[ "$out" != bench/results ] && cp bench/results/bench_fusion-*.json "$out"/ 2>/dev/null
exit 0
