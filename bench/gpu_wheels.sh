#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with every wheel the GPU pass needs on a machine that cannot
# reach a package index: the project's runtime packages and the test tools, with all their
# dependencies, for the GPU machine's Python and platform. Never torch: a CUDA build is
# gigabytes; the pass uses the machine's own.
#
#   bash bench/gpu_wheels.sh [--python-version 3.12] [--platform manylinux_2_28_x86_64]
#                            [--dir .whl]
#
# Run it where pip reaches an index. --platform may be given several times (the default
# accepts every manylinux tag of x86_64 up to glibc 2.28). Prints the folder's size and
# fails (exit 1) above 64 MiB, what the device machine accepts in all (carry .whl).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
PY_VERSION=3.12
DIR=.whl
PLATFORMS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PY_VERSION=$2; shift ;;
        --platform) PLATFORMS+=("$2"); shift ;;
        --dir) DIR=$2; shift ;;
        *) echo "gpu_wheels: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#PLATFORMS[@]} = 0 ] && PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64
                                       manylinux2014_x86_64 manylinux1_x86_64)
LIMIT_MIB=64
# The pass imports these (bench/gpu_check.sh MODULES); pip adds their dependencies.
# setuptools: the C markers are built on the device (setup.py), and Python 3.12 has none
PACKAGES=(pyzmq psutil pandas nvidia-ml-py prometheus_client pytest pytest-timeout setuptools)
PLATFORM_ARGS=()
for platform in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$platform"); done

mkdir -p "$DIR"
# The versions this project's CI runs (the interpreter's installed set, no torch), so the
# device tests what CI tested; a package it lacks resolves to the newest that fits.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null \
    | grep -v -i -E '^(torch|nvidia-(cu|nccl|nvtx|nvjitlink|cusparselt)|triton)' >"$CONSTRAINTS" || true
# --only-binary with an explicit --python-version resolves the dependencies for that
# interpreter, not this one (markers such as python_version < "3.11" included).
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp "${PLATFORM_ARGS[@]}" \
    --constraint "$CONSTRAINTS" -d "$DIR" "${PACKAGES[@]}"
if ls "$DIR" | grep -qi '^torch-'; then
    echo "gpu_wheels: $DIR holds a torch wheel: remove it (the pass uses the machine's torch)" >&2
    exit 1
fi
SIZE_KIB=$(du -sk "$DIR" | cut -f1)
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels for CPython $PY_VERSION" \
     "(${PLATFORMS[*]}) in $DIR: $(( SIZE_KIB / 1024 )) MiB"
ls "$DIR"
if [ "$SIZE_KIB" -gt $(( LIMIT_MIB * 1024 )) ]; then
    echo "gpu_wheels: $DIR is over $LIMIT_MIB MiB, more than the device machine takes" >&2
    exit 1
fi
