#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (no registry there): the device tier's
# tests, the GPU cases of the UCX transport, and the device-tier benchmark.
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
python3 -c "import cupy, ucxx; print('cupy', cupy.__version__, 'ucxx', ucxx.__version__)" \
    2>&1 | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -p no:cacheprovider -q -rs tests/test_device.py tests/test_ucx.py \
    2>&1 | tee "$OUT/tests.log"
timeout 240 python3 -m pytest -p no:cacheprovider -q -s benches/bench_device_tier.py \
    --benchmark-disable-gc 2>&1 | tee "$OUT/bench.log"
