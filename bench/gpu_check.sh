#!/usr/bin/env bash
# The GPU pass: every test that needs a real CUDA device and NVML, then the GPU overhead
# benchmark, with the figures written to bench/RESULTS.md ("## GPU pass").
#
#   bash bench/gpu_check.sh [--dry-run] [--results FILE] [--wheels DIR]
#
# Uses the machine's own CUDA build of torch (python3, or $PYTHON); it never installs
# torch. Python packages the project needs and the machine lacks (often pyzmq) come
# from wheels in DIR (default .whl, when present), installed with --no-index --no-deps
# into a scratch folder; torch wheels there are refused. For a machine that cannot reach
# a package index, fetch them beforehand where pip works, for its Python, e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl pyzmq
# (name every missing package; the script lists them). Fails loudly (exit 3) when
# torch.cuda.is_available() is False. A GPU test that skips on a GPU machine did not
# check anything: skips are counted, listed and make the pass fail (except those for
# want of a second GPU).
#
# --dry-run, for a machine without a GPU: checks the packages, collects the GPU tests
# (they must import and be found by name), runs the overhead benchmark's and the
# memory-read measurement's CPU paths, and writes the section with every GPU part
# "not run" to FILE (default: a scratch file, so bench/RESULTS.md keeps real figures).
#
# Bounded by construction, under 8 minutes on one GPU: each step has its own timeout
# (packages 60 s, tests 240 s with 120 s per test, memory reads 30 s, overhead 150 s).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
DRY=0
RESULTS_FILE=""
WHEELS=".whl"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --results) RESULTS_FILE=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
if [ -z "$RESULTS_FILE" ]; then
    if [ $DRY = 1 ]; then RESULTS_FILE=$SCRATCH/RESULTS.md; else RESULTS_FILE=bench/RESULTS.md; fi
fi
# The tests that need a CUDA device or an NVIDIA driver (marked "gpu"), by name.
GPU_TESTS=(tests/unit/test_gpu_real.py tests/unit/test_nvml_gpu.py
           tests/e2e/test_gpu_run.py tests/e2e/test_instrument_gpu.py)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)

echo "== packages"
MODULES="zmq psutil pandas numpy pynvml prometheus_client pytest pytest_timeout"
missing() { "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
MISSING=$(missing $MODULES)
if [ -n "$MISSING" ] && [ -d "$WHEELS" ]; then
    if ls "$WHEELS" | grep -qi '^torch-'; then
        echo "gpu_check: FATAL: $WHEELS holds a torch wheel; the machine's own torch is used" >&2
        exit 2
    fi
    echo "installing from $WHEELS for: $MISSING"
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SCRATCH/site" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:$SCRATCH/site"
    MISSING=$(missing $MODULES)
fi
if [ -n "$MISSING" ]; then
    echo "gpu_check: FATAL: Python packages missing: $MISSING (carry their wheels in $WHEELS)" >&2
    exit 2
fi

echo "== device"
DEVICE=$("$PY" - <<'EOF'
import torch
if torch.cuda.is_available():
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
else:
    print(f"none (torch {torch.__version__}: torch.cuda.is_available() is False)")
EOF
) || { echo "gpu_check: FATAL: torch does not import" >&2; exit 3; }
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "device: $DEVICE; driver: ${DRIVER:-none}"
if [ $DRY = 0 ] && [[ "$DEVICE" == none* ]]; then
    echo "gpu_check: FATAL: torch.cuda.is_available() is False: this is no GPU pass" \
         "(use --dry-run on a machine without a GPU)" >&2
    exit 3
fi

echo "== GPU tests"
# counts "passed failed skipped errors unexpected-skips", from pytest's JUnit XML; a skip
# for want of a second GPU is expected on a one-GPU machine, any other is not
counts() { "$PY" - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0 1 0"); sys.exit()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n, f, s, e = (int(suite.get(k, 0)) for k in ("tests", "failures", "skipped", "errors"))
expected = sum("two CUDA devices" in (skip.get("message") or "")
               for skip in suite.iter("skipped"))
print(n - f - s - e, f, s, e, s - expected)
EOF
}
if [ $DRY = 1 ]; then
    COLLECTED=$(timeout 120 "$PY" -m pytest -q --collect-only -p no:cacheprovider \
        "${GPU_TESTS[@]}" 2>&1 | grep -c '::') || true
    if [ "$COLLECTED" -lt 1 ]; then
        echo "gpu_check: FATAL: no GPU test collected" >&2; exit 4
    fi
    TESTS_LINE="not run (dry run): $COLLECTED GPU tests collected in ${#GPU_TESTS[@]} files"
    TESTS_OK=1
else
    timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 120 \
        --junitxml "$SCRATCH/gpu.xml" "${GPU_TESTS[@]}" 2>&1 | tee "$SCRATCH/tests.log"
    read -r PASSED FAILED SKIPPED ERRORS UNEXPECTED <<<"$(counts "$SCRATCH/gpu.xml")"
    TESTS_LINE="$PASSED passed, $FAILED failed, $SKIPPED skipped ($UNEXPECTED of them"
    TESTS_LINE+=" not for want of a second GPU), $ERRORS errors"
    TESTS_OK=$(( FAILED + UNEXPECTED + ERRORS == 0 ))
    if [ "$SKIPPED" != 0 ]; then
        echo "gpu_check: $SKIPPED GPU tests SKIPPED on a GPU machine:"
        grep '^SKIPPED' "$SCRATCH/tests.log"
    fi
fi
echo "tests: $TESTS_LINE"

echo "== host cost of the allocator reads of one phase"
MEM_ARGS=(); [ $DRY = 1 ] && MEM_ARGS=(--fake --reads 200)  # the fake is slow: fewer
MEMORY_LINE=$(timeout 30 "$PY" bench/gpu_memory_cost.py "${MEM_ARGS[@]}") \
    || MEMORY_LINE="failed (exit $?)"
[ $DRY = 1 ] && MEMORY_LINE="not run on a GPU (dry run); on the fake: $MEMORY_LINE"
echo "memory reads: $MEMORY_LINE"

echo "== GPU overhead benchmark"
if [ $DRY = 1 ]; then
    # Its CPU path: the models and the marked path run two steps, nothing is written.
    if timeout 150 "$PY" bench/gpu_overhead.py --no-write >"$SCRATCH/overhead.log" 2>&1; then
        OVERHEAD_LINE="not run (dry run; its CPU smoke path passed)"
        OVERHEAD_OK=1
    else
        OVERHEAD_LINE="not run (dry run; its CPU smoke path FAILED)"
        OVERHEAD_OK=0
    fi
else
    OVERHEAD_ARGS=(--repeats 7 --steps 20)
    [ "$RESULTS_FILE" != bench/RESULTS.md ] && OVERHEAD_ARGS+=(--no-write)
    timeout 150 "$PY" bench/gpu_overhead.py "${OVERHEAD_ARGS[@]}" 2>&1 \
        | tee "$SCRATCH/overhead.log"
    RC=${PIPESTATUS[0]}
    OVERHEAD_OK=$(( RC == 0 ))
    OVERHEAD_LINE="exit $RC; $(grep -c '^| ' "$SCRATCH/overhead.log") table lines, see \"## GPU overhead\""
fi
tail -3 "$SCRATCH/overhead.log"
echo "overhead: $OVERHEAD_LINE"

ELAPSED=$(( $(date +%s) - T0 ))
MODE="GPU pass"; [ $DRY = 1 ] && MODE="dry run, no GPU: every GPU part not run"
"$PY" - "$RESULTS_FILE" <<EOF
import sys
from pathlib import Path
from bench.results import write_section
write_section("""## GPU pass

\`bash bench/gpu_check.sh$([ $DRY = 1 ] && echo ' --dry-run')\` on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC'), $ELAPSED s ($MODE).

- device: $DEVICE; driver: ${DRIVER:-none}
- GPU tests (${GPU_TESTS[*]}): $TESTS_LINE
- host cost of a phase's allocator reads ("bound" peaks): $MEMORY_LINE
- GPU overhead benchmark: $OVERHEAD_LINE
""", Path(sys.argv[1]))
EOF
echo "wrote the \"## GPU pass\" section of $RESULTS_FILE ($ELAPSED s)"
if [ "$TESTS_OK" = 1 ] && [ "$OVERHEAD_OK" = 1 ]; then
    echo "gpu_check: OK ($MODE)"
    exit 0
fi
echo "gpu_check: FAILED (tests: $TESTS_LINE; overhead: $OVERHEAD_LINE)" >&2
exit 1
