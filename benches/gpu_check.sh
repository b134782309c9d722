#!/usr/bin/env bash
# shellcheck disable=SC2317  # the steps are functions that run_step calls through "$@"
# The GPU checks, in ONE call on a lent GPU machine (no registry there): the connector moving
# CUDA KV caches built as vLLM 0.32's worker builds them (tests/test_gpu_connector.py: one
# allocation for every layer in LBNHC, LBHNC and BLHNC, bf16 and fp8, 1 and 8 KV heads, MLA,
# staged and direct; the engine's writes on a stream of its own, landing late; a killed
# server), the device tier's tests, the GPU cases of the UCX transport, and the benchmarks
# (device tier; the connector on Llama-3-8B's shape). torch and cupy come from the image.
#
# How to run it with the device tool (benches/gpu_wheels.sh's header says more):
#   1. optional, a 10-second probe of the image (run, timeout_s 60):
#        python3 -V; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; pip list
#   2. here: bash benches/gpu_wheels.sh 3.12 manylinux_2_28_x86_64   (into .whl/, about 55 MB)
#   3. run: command `bash benches/gpu_check.sh`, carry [".whl"], timeout_s 600
#
# The steps; each one's exit status goes to $OUT/status.txt, and the script exits with the
# worst (largest) of them: 0 only when everything was there, ran and passed.
#   install    .whl/*.whl into /tmp/site, first on PYTHONPATH (then this repository)
#   preflight  imports everything the run needs before anything else runs, one line per
#              module that is missing. Without torch with CUDA, numpy, msgpack, xxhash,
#              blake3, pyzmq, lmdb, prometheus_client, pytest or kvbridge itself (from this
#              repository) nothing can run: the script stops there (status 3). Without cupy,
#              ucxx or pytest-benchmark it goes on (the tests that need them skip, the bench
#              cannot run), with status 1.
#   tests      tests/test_gpu_connector.py tests/test_device.py tests/test_ucx.py, 240 s at
#              most; then tests/test_nixl.py's GPU case in a process of its own (60 s), where
#              the image has NIXL (nixl-cu12 1.5.1's wheel, 68.6 MB, is over the carry)
#   bench      benches/bench_device_tier.py benches/bench_connector_gpu.py, 170 s at most
# About 8 minutes at most in all.
#
# $OUT (the device tool's; /tmp/gpu-check elsewhere) gets six files, each headed by the
# device (nvidia-smi) and the date (date -u): gpu.txt (the install and the preflight),
# tests.log, bench.log, figures.txt (the bench's table of medians and ratios), bench.json
# (pytest-benchmark's, the device and date added to its machine_info) and status.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rm -f "$OUT"/{gpu.txt,tests.log,bench.log,figures.txt,bench.json,status.txt}
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null; then
    DEVICE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
        head -1)
fi
DEVICE=${DEVICE:-unknown (no answer from nvidia-smi)}
stamp() {
    printf '# device: %s\n# date: %s\n' "$DEVICE" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}

worst=0
record() { # step, exit status
    echo "$1 $2" >>"$OUT/status.txt"
    if (($2 > worst)); then worst=$2; fi
}

run_step() { # step, log file in $OUT, command...: the command's own status is recorded
    local step=$1 log=$2
    shift 2
    [[ -e $OUT/$log ]] || stamp >"$OUT/$log"
    { echo "== $step"; "$@"; } 2>&1 | tee -a "$OUT/$log"
    record "$step" "${PIPESTATUS[0]}"
}

finish() {
    echo "worst $worst" >>"$OUT/status.txt"
    cat "$OUT/status.txt"
    exit "$worst"
}

install_wheels() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
}

preflight() {
    "$PY" - <<'PYTHON'
"""One line per module the run needs: what it is, or what is missing and what that costs."""
import importlib
import importlib.metadata
import os
import sys

REPO = os.path.realpath(os.getcwd())


def version(module, dist):
    found = getattr(module, "__version__", None)
    if found is None:
        try:
            found = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found = "?"
    return str(found)


def torch_detail(torch):
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (a CPU build, or no GPU seen)")
    if not hasattr(torch.cuda, "_sleep"):
        raise RuntimeError("torch.cuda._sleep is missing (the GPU tests delay a stream with it)")
    torch.zeros(1, device="cuda")
    return f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}"


def cupy_detail(cupy):
    cupy.zeros(1, dtype=cupy.uint8)
    return f"{cupy.cuda.runtime.getDeviceCount()} device(s)"


def kvbridge_detail(kvbridge):
    where = os.path.realpath(os.path.dirname(kvbridge.__file__))
    if not where.startswith(REPO + os.sep):
        raise RuntimeError(f"imported from {where}, not from this repository ({REPO})")
    for name in ("store", "transfer", "bindings.core", "tools.cli"):
        importlib.import_module(f"kvbridge.{name}")
    return "store, transfer, bindings.core, tools.cli"


# module, distribution, needed by every step, what is lost without it, detail
MODULES = [
    ("torch", "torch", True, "nothing runs", torch_detail),
    ("numpy", "numpy", True, "nothing runs", None),
    ("msgpack", "msgpack", True, "kvbridge does not import", None),
    ("xxhash", "xxhash", True, "kvbridge does not import", None),
    ("blake3", "blake3", True, "kvbridge does not import", None),
    ("zmq", "pyzmq", True, "kvbridge does not import", None),
    ("lmdb", "lmdb", True, "kvbridge does not import", None),
    ("prometheus_client", "prometheus-client", True, "kvbridge does not import", None),
    ("pytest", "pytest", True, "nothing runs", None),
    ("kvbridge", "kvbridge", True, "nothing runs", kvbridge_detail),
    ("cupy", "cupy", False, "the device tier and the direct path skip", cupy_detail),
    ("ucxx", "ucxx", False, "the direct path and the UCX GPU cases skip", None),
    ("nixl_cu12", "nixl-cu12", False, "the nixl cases skip (its wheel, 68.6 MB, is over the carry)", None),
    ("pytest_benchmark", "pytest-benchmark", False, "the bench cannot run", None),
]

print(f"python {sys.version.split()[0]} at {sys.executable}")
required_missing = optional_missing = 0
for name, dist, required, lost, detail in MODULES:
    try:
        module = importlib.import_module(name)
        extra = detail(module) if detail else ""
    except Exception as exc:  # noqa: BLE001  (any failure to import or use is a finding)
        what = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"MISSING  {name} ({dist}): {what}; without it {lost}")
        if required:
            required_missing += 1
        else:
            optional_missing += 1
        continue
    path = os.path.dirname(getattr(module, "__file__", None) or "?")
    print("  ".join(p for p in (f"ok       {name} {version(module, dist)}", extra, f"({path})") if p))
sys.exit(3 if required_missing else 1 if optional_missing else 0)
PYTHON
}

run_tests() { # the nixl cases in a process of their own (one UCX build a process)
    timeout -k 10 240 "$PY" -m pytest -p no:cacheprovider -q \
        tests/test_gpu_connector.py tests/test_device.py tests/test_ucx.py
    local first=$?
    KVBRIDGE_TEST_NIXL=1 timeout -k 10 60 "$PY" -m pytest -p no:cacheprovider -q \
        tests/test_nixl.py -k gpu
    local second=$?
    return $((first > second ? first : second))
}

run_bench() {
    timeout -k 10 170 "$PY" -m pytest -p no:cacheprovider -q -s \
        benches/bench_device_tier.py benches/bench_connector_gpu.py \
        --benchmark-disable-gc --benchmark-json "$OUT/bench.json"
}

stamp_json() { # the device and the date into pytest-benchmark's machine_info
    "$PY" - "$OUT/bench.json" "$DEVICE" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" <<'PYTHON'
import json
import sys

path, device, date = sys.argv[1:]
with open(path) as f:
    data = json.load(f)
data.setdefault("machine_info", {}).update(gpu=device, date_utc=date)
with open(path, "w") as f:
    json.dump(data, f, indent=2)
PYTHON
}

if compgen -G ".whl/*.whl" >/dev/null; then
    run_step install gpu.txt install_wheels
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    { stamp && echo "== install: no .whl/ (benches/gpu_wheels.sh makes it)"; } | tee "$OUT/gpu.txt"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
run_step preflight gpu.txt preflight
if grep -q '^preflight 3$' "$OUT/status.txt"; then
    echo "preflight: a module every step needs is missing (above); nothing else ran" |
        tee -a "$OUT/gpu.txt"
    finish
fi

run_step tests tests.log run_tests
run_step bench bench.log run_bench

{
    stamp
    sed -n '/kvbridge vs baseline/,$p' "$OUT/bench.log" | grep . ||
        echo "no figures: the bench printed no table (bench.log says why)"
} >"$OUT/figures.txt"
if [[ -s $OUT/bench.json ]]; then
    stamp_json || record "bench.json" 1
fi
finish
