#!/usr/bin/env bash
# Wheels for benches/gpu_check.sh, fetched HERE (a machine with a package registry) for the
# lent GPU machine, which has none. They go into .whl/ (ignored by git; this script empties
# it first: two versions of one package there would stop the whole install), the device
# tool carries that folder (`carry: [".whl"]`), and gpu_check.sh installs it with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
#   benches/gpu_wheels.sh PYVER PLATFORM [ITEM ...]
#   e.g. benches/gpu_wheels.sh 3.12 manylinux_2_28_x86_64
#
# The sequence, with the device tool (15 minutes of device time in all, starting a machine
# costing one or two of them):
#   1. A 10-second probe, to learn the image's Python, CUDA and packages (run, timeout_s 60):
#        python3 -V; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; pip list
#      KINDS.md (the device notes) read in 2026-11: Python 3.12.3, torch 2.11.0+cu130 (CUDA
#      13, driver 580), cupy-cuda13x 14.2.0, cuda-bindings, cuda-core, msgpack, xxhash,
#      prometheus-client, pytest, pytest-benchmark and py-cpuinfo there; no pyzmq, blake3,
#      lmdb or ucxx. With that image, the probe can be skipped.
#   2. Here: benches/gpu_wheels.sh 3.12 manylinux_2_28_x86_64   (CUDA=12 for a CUDA 12 image)
#   3. The check (run): command `bash benches/gpu_check.sh`, carry [".whl"], timeout_s 600.
#
# ITEMs (default: image-lacks = pyzmq blake3 lmdb ucxx; `all` = every item):
#   pyzmq msgpack xxhash blake3 lmdb prometheus-client pytest pytest-benchmark ucxx cupy
# Versions are the ones the development venv runs (.venv). `ucxx` is ucxx-cuNN with what it
# needs that the image lacks: libucxx-cuNN, libucx-cuNN (< 1.22, libucxx's bound),
# rmm-cuNN, librmm-cuNN and rapids-logger; cuda-core, nvidia-ml-py and numpy come from the
# image, and so does cuda-bindings for CUDA 13 (rmm-cu13 wants >= 13.0.1). With CUDA=12,
# rmm-cu12 wants cuda-bindings < 13, which the image's CUDA 13 stack does not have: the
# item then carries cuda-bindings 12.9.10 too. NN is $CUDA: 13 by default, the image's
# (torch cu130, cupy-cuda13x); UCX's CUDA transports must match the driver's CUDA stack.
#
# Sizes for cp312 manylinux_2_28_x86_64, measured 2026-12 (MB):
#   pyzmq 0.86, blake3 0.38, lmdb 0.57, msgpack 0.48, xxhash 0.47, prometheus-client 0.06,
#   pytest 0.41, pytest-benchmark 0.07 with py-cpuinfo2 0.02;
#   ucxx (cu13) 53.4: libucx-cu13 42.0, librmm-cu13 4.8, libucxx-cu13 4.7, rmm-cu13 0.96,
#   ucxx-cu13 0.73, rapids-logger 0.27 (cu12: 53.5, and cuda-bindings 7.6);
#   cupy-cuda12x 136 alone: cupy can never travel; the image's cupy-cuda13x must do.
# The device tool carries at most 64 MiB (67.1 MB), the working tree (about 5 MB) included:
# the default set (about 55 MB) fits; `all` without cupy adds 1.5 MB and fits; cupy does not.
# The script adds up what would travel and fails (exit 3) when it is over, naming the sizes.
set -euo pipefail
cd "$(dirname "$0")/.."

if (($# < 2)); then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
fi
PYVER=$1
PLATFORM=$2
shift 2
CUDA=${CUDA:-13}
PIP=${PIP:-python3 -m pip}
LIMIT=$((64 << 20))

declare -A ITEMS=(
    [pyzmq]="pyzmq==27.3.0"
    [msgpack]="msgpack==1.2.4"
    [xxhash]="xxhash==4.1.0"
    [blake3]="blake3==1.0.11"
    [lmdb]="lmdb==3.0.0"
    [prometheus-client]="prometheus-client==0.26.0"
    [pytest]="pytest==9.2.0"
    [pytest-benchmark]="pytest-benchmark==5.3.1 py-cpuinfo2==10.1.1"
    [ucxx]="ucxx-cu$CUDA==0.52.0 libucxx-cu$CUDA==0.52.0 libucx-cu$CUDA==1.21.0 rmm-cu$CUDA==26.10.0 librmm-cu$CUDA==26.10.0 rapids-logger==0.3.0"
    [cupy]="cupy-cuda${CUDA}x==14.2.0"
)
if [[ $CUDA == 12 ]]; then
    ITEMS[ucxx]+=" cuda-bindings==12.9.10"
fi
ALL="pyzmq msgpack xxhash blake3 lmdb prometheus-client pytest pytest-benchmark ucxx cupy"
IMAGE_LACKS="pyzmq blake3 lmdb ucxx"

names=()
for item in "${@:-image-lacks}"; do
    case $item in
        all) read -ra more <<<"$ALL" ;;
        image-lacks) read -ra more <<<"$IMAGE_LACKS" ;;
        *)
            if [[ -z ${ITEMS[$item]+set} ]]; then
                echo "gpu_wheels.sh: unknown item '$item' (items: $ALL, all, image-lacks)" >&2
                exit 2
            fi
            more=("$item")
            ;;
    esac
    names+=("${more[@]}")
done

# pip matches a platform tag exactly: name every manylinux level up to the one given.
platforms=()
if [[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    glibc=${BASH_REMATCH[1]}
    arch=${BASH_REMATCH[2]}
    for ((minor = glibc; minor >= 5; minor--)); do
        platforms+=(--platform "manylinux_2_${minor}_$arch")
    done
    ((glibc >= 17)) && platforms+=(--platform "manylinux2014_$arch")
    ((glibc >= 12)) && platforms+=(--platform "manylinux2010_$arch")
    platforms+=(--platform "manylinux1_$arch")
else
    platforms+=(--platform "$PLATFORM")
fi

requirements=()
for name in "${names[@]}"; do
    read -ra specs <<<"${ITEMS[$name]}"
    requirements+=("${specs[@]}")
done
# one requirement once, in the order first named
mapfile -t requirements < <(printf '%s\n' "${requirements[@]}" | awk '!seen[$0]++')

mkdir -p .whl
rm -f .whl/*.whl
echo "fetching for cp${PYVER/./} $PLATFORM, CUDA $CUDA: ${requirements[*]}"
# shellcheck disable=SC2086  # PIP is a command line
$PIP download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PYVER" "${platforms[@]}" --dest .whl "${requirements[@]}"

wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$( (git ls-files -z --cached && git ls-files -z --others --exclude-standard) |
    xargs -0 du -cb 2>/dev/null | awk '$2 == "total" { sum += $1 } END { print sum + 0 }')
du -b .whl/*.whl | sort -n | awk '{ printf "%8.2f MB  %s\n", $1 / 1e6, $2 }'
awk -v w="$wheels" -v t="$tree" -v l="$LIMIT" 'BEGIN {
    printf "%8.2f MB  the wheels\n%8.2f MB  the working tree\n", w / 1e6, t / 1e6
    printf "%8.2f MB  together, of the %.2f MB the device tool carries\n", (w + t) / 1e6, l / 1e6
}'
if ((wheels + tree > LIMIT)); then
    echo "gpu_wheels.sh: over the device tool's 64 MiB: name fewer items (cupy is 136 MB;" \
        "ucxx's libucx 42 MB)" >&2
    exit 3
fi
echo "fits: carry [\".whl\"] with the run of benches/gpu_check.sh"
