#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (no registry there): the connector moving
# CUDA KV caches (FlashAttention and MLA layouts, bf16 and fp8, staged and direct, a killed
# server), the device tier's tests, the GPU cases of the UCX transport, and the benchmarks
# (device tier; the connector on Llama-3-8B's shape). torch comes from the machine's image.
#
# Python packages the image lacks travel as wheels in .whl/ (pyzmq, lmdb, blake3, ucxx-cu12
# with libucxx/libucx/librmm/rapids-logger); they install into /tmp/site. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for module in torch cupy ucxx; do
    python3 -c "import $module; print('$module', $module.__version__)" 2>&1 | tail -1
done | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu_connector.py \
    tests/test_device.py tests/test_ucx.py 2>&1 | tee "$OUT/tests.log"
timeout 300 python3 -m pytest -p no:cacheprovider -q -s benches/bench_device_tier.py \
    benches/bench_connector_gpu.py --benchmark-disable-gc 2>&1 | tee "$OUT/bench.log"
