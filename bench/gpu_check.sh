#!/usr/bin/env bash
# The GPU pass: on a machine with a GPU, in one call under 8 minutes, every test that needs
# a real CUDA device and NVML on both bases of the markers (the C speedups and
# MARKERS_PURE_PYTHON=1), the device measurements (bench/gpu_probe.py), the allocator-read
# cost and the GPU overhead benchmark; every log and figure kept in --out.
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--wheels DIR]
#
# Meant for a bare offline GPU machine (docs: bench/README.md, "The GPU pass"):
# - Python packages the machine lacks come from the wheels in DIR (default .whl, filled
#   beforehand by bench/gpu_wheels.sh where pip works): those whose distribution is not
#   installed are put in OUT/site with `pip install --no-index --no-deps --target`
#   (unzipped when the machine has no pip). A torch wheel there is refused.
# - torch is the machine's own CUDA build, checked by importing it: no torch, or torch
#   without CUDA, is one FATAL line and exit 3.
# - The C markers are built in place (setup.py build_ext); when that fails the log says
#   why and the tests run on the pure-Python base only (the section says so).
# - OUT (default $OUT, else .gpu-pass) keeps: gpu_check.log (this output), build.log,
#   gpu-tests-c.xml/.log and gpu-tests-pure.xml/.log (JUnit XML and the test log of each
#   base), drift.json/.log, probe.md/.log, memory.log, overhead.log and RESULTS.md (the
#   "## GPU pass" section, the probe's figures and the overhead table). Nothing in it is
#   deleted, on success or failure.
# - A GPU test that skips on a GPU machine checked nothing: skips are counted, listed and
#   fail the pass (except those for want of a second GPU).
# - Bounded: one budget of BUDGET_S (450 s) for all steps, each step also capped (packages
#   60 s, build 60 s, tests 150 s per base, memory reads 30 s, overhead 150 s, probe 60 s);
#   a step that the budget no longer allows is reported "not run (time)".
#
# --dry-run, for CI without a GPU: the same steps on the CPU and the fakes: packages, the
# torch import, the C build, the GPU tests collected by name on both bases, the drift and
# probe on the fakes (fake figures, labelled so), the allocator reads on the fake, the
# overhead benchmark's CPU smoke path; the section says what did not run on a GPU.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
DRY=0
OUT_DIR=${OUT:-$ROOT/.gpu-pass}
WHEELS=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUT_DIR=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
BUDGET_S=450
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# step_timeout CAP: the step's timeout, CAP or what the budget has left (0: do not start)
step_timeout() { local l; l=$(left); [ "$l" -lt 15 ] && { echo 0; return; }; echo $(( $1 < l ? $1 : l )); }
GPU_TESTS=(tests/unit/test_gpu_real.py tests/unit/test_nvml_gpu.py
           tests/e2e/test_gpu_run.py tests/e2e/test_instrument_gpu.py)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
NOT_RUN=()  # what this pass did not run, said in the section
echo "gpu_check: $( [ $DRY = 1 ] && echo 'dry run' || echo 'GPU pass' ) on $(hostname)," \
     "$(date -u '+%Y-%m-%d %H:%M:%S UTC'), out: $OUT_DIR"

echo "== packages"
MODULES="zmq psutil pandas numpy pynvml prometheus_client pytest pytest_timeout"
missing() { "$PY" - "$@" <<'EOF'
import importlib, sys
gone = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # ImportError, or a broken install that raises otherwise
        gone.append(name)
print(" ".join(gone))
EOF
}
MISSING=$(missing $MODULES)
PACKAGES_LINE="all present"
if [ -n "$MISSING" ] && [ -d "$WHEELS" ]; then
    if ls "$WHEELS" | grep -qi '^torch-'; then
        echo "gpu_check: FATAL: $WHEELS holds a torch wheel; the machine's own torch is used" >&2
        exit 2
    fi
    # the wheels of the distributions this Python lacks (by metadata, name normalised)
    NEEDED=$("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md, re, sys
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    dist = wheel.name.split("-")[0]
    try:
        md.version(re.sub(r"[-_.]+", "-", dist))
    except md.PackageNotFoundError:
        print(wheel)
EOF
)
    echo "missing modules: $MISSING; installing from $WHEELS: $(echo $NEEDED | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
    SITE=$OUT_DIR/site
    if "$PY" -m pip --version >/dev/null 2>&1; then
        timeout "$(step_timeout 60)" "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --disable-pip-version-check --target "$SITE" $NEEDED || exit 2
        HOW="pip install --no-index --no-deps --target"
    else  # a wheel is a zip laid out for site-packages
        "$PY" - "$SITE" $NEEDED <<'EOF' || exit 2
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
        HOW="unzipped (this Python has no pip)"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    PACKAGES_LINE="installed $(echo $NEEDED | wc -w) wheels ($HOW) for: $MISSING"
    MISSING=$(missing $MODULES)
fi
if [ -n "$MISSING" ]; then
    echo "gpu_check: FATAL: Python packages missing: $MISSING (carry their wheels in $WHEELS:" \
         "bash bench/gpu_wheels.sh)" >&2
    exit 2
fi
echo "packages: $PACKAGES_LINE"

echo "== torch"
DEVICE=$("$PY" - 2>&1 <<'EOF'
try:
    import torch
except Exception as exc:
    print(f"no torch: import torch failed: {type(exc).__name__}: {exc}")
    raise SystemExit(3)
if torch.cuda.is_available():
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}")
else:
    print(f"none (torch {torch.__version__}: torch.cuda.is_available() is False)")
EOF
)
RC=$?
DEVICE=$(echo "$DEVICE" | tail -1)
if [ $RC != 0 ]; then
    echo "gpu_check: FATAL: $DEVICE: the pass uses the machine's own CUDA build of torch" >&2
    exit 3
fi
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "device: $DEVICE; driver: ${DRIVER:-none}"
if [ $DRY = 0 ] && [[ "$DEVICE" == none* ]]; then
    echo "gpu_check: FATAL: torch.cuda.is_available() is False: this is no GPU pass" \
         "(use --dry-run on a machine without a GPU)" >&2
    exit 3
fi
FAKE=(); [ $DRY = 1 ] && FAKE=(--fake)

echo "== GPU timer drift, in the background"
# the dry run's 10 s take an event every 0.25 s: three points (one every 5 s) left its
# slope to one host stamp's scheduling jitter, tens of ppm on a busy machine
DRIFT_S=240; DRIFT_EVERY_S=5; [ $DRY = 1 ] && DRIFT_S=10 DRIFT_EVERY_S=0.25
"$PY" bench/gpu_probe.py drift "${FAKE[@]}" --seconds $DRIFT_S --every $DRIFT_EVERY_S \
    --json "$OUT_DIR/drift.json" \
    >"$OUT_DIR/drift.log" 2>&1 &
DRIFT_PID=$!

echo "== C markers"
BASES=(pure)
if timeout "$(step_timeout 60)" "$PY" setup.py build_ext --inplace -q >"$OUT_DIR/build.log" 2>&1 \
        && "$PY" -c "import markers._speedups" >>"$OUT_DIR/build.log" 2>&1; then
    BUILD_LINE="built (setup.py build_ext --inplace)"
    BASES=(c pure)
else
    BUILD_LINE="NOT built: $(grep -v '^\s*$' "$OUT_DIR/build.log" | tail -1 | cut -c1-200)"
    NOT_RUN+=("the GPU tests on the C markers ($BUILD_LINE)")
fi
echo "C markers: $BUILD_LINE"

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
TESTS_OK=1
TESTS_LINES=()
for BASE in "${BASES[@]}"; do
    echo "== GPU tests, $BASE markers"
    PURE=0; [ "$BASE" = pure ] && PURE=1
    LOG=$OUT_DIR/gpu-tests-$BASE.log
    XML=$OUT_DIR/gpu-tests-$BASE.xml
    CAP=150; [ $DRY = 1 ] && CAP=120
    LIMIT=$(step_timeout $CAP)
    if [ "$LIMIT" = 0 ]; then
        TESTS_LINES+=("$BASE: not run (time)"); TESTS_OK=0; continue
    fi
    if [ $DRY = 1 ]; then
        MARKERS_PURE_PYTHON=$PURE timeout "$LIMIT" "$PY" -m pytest -q --collect-only \
            -p no:cacheprovider --junitxml "$XML" "${GPU_TESTS[@]}" >"$LOG" 2>&1
        COLLECTED=$(grep -c '::' "$LOG")
        if [ "$COLLECTED" -lt 1 ]; then
            echo "gpu_check: FATAL: no GPU test collected ($BASE markers)" >&2; exit 4
        fi
        TESTS_LINES+=("$BASE: not run (dry run): $COLLECTED GPU tests collected in ${#GPU_TESTS[@]} files")
    else
        MARKERS_PURE_PYTHON=$PURE timeout "$LIMIT" "$PY" -m pytest -q -rs -p no:cacheprovider \
            --timeout 120 --junitxml "$XML" "${GPU_TESTS[@]}" 2>&1 | tee "$LOG"
        read -r PASSED FAILED SKIPPED ERRORS UNEXPECTED <<<"$(counts "$XML")"
        TESTS_LINES+=("$BASE: $PASSED passed, $FAILED failed, $SKIPPED skipped ($UNEXPECTED of them not for want of a second GPU), $ERRORS errors")
        [ $(( FAILED + UNEXPECTED + ERRORS )) = 0 ] || TESTS_OK=0
        if [ "$SKIPPED" != 0 ]; then
            echo "gpu_check: $SKIPPED GPU tests SKIPPED on a GPU machine ($BASE markers):"
            grep '^SKIPPED' "$LOG"
        fi
    fi
    echo "tests: ${TESTS_LINES[-1]}"
done

echo "== host cost of the allocator reads of one phase"
MEM_ARGS=(); [ $DRY = 1 ] && MEM_ARGS=(--fake --reads 200)  # the fake is slow: fewer
LIMIT=$(step_timeout 30)
if [ "$LIMIT" = 0 ]; then
    MEMORY_LINE="not run (time)"
else
    MEMORY_LINE=$(timeout "$LIMIT" "$PY" bench/gpu_memory_cost.py "${MEM_ARGS[@]}" 2>"$OUT_DIR/memory.log") \
        || MEMORY_LINE="failed (exit $?; memory.log)"
fi
echo "$MEMORY_LINE" >>"$OUT_DIR/memory.log"
[ $DRY = 1 ] && MEMORY_LINE="not run on a GPU (dry run); on the fake: $MEMORY_LINE"
echo "memory reads: $MEMORY_LINE"

echo "== device measurements (bench/gpu_probe.py)"
# the drift run ends by itself after DRIFT_S; wait for it at most what the budget allows
WAIT_END=$(( $(date +%s) + $(left) - 200 ))
while kill -0 $DRIFT_PID 2>/dev/null && [ "$(date +%s)" -lt $WAIT_END ]; do sleep 1; done
kill $DRIFT_PID 2>/dev/null && echo "drift run stopped early (time): no drift figure"
LIMIT=$(step_timeout 60)
PROBE_OK=1
if [ "$LIMIT" = 0 ]; then
    PROBE_LINE="not run (time)"; PROBE_OK=0
elif timeout "$LIMIT" "$PY" bench/gpu_probe.py probe "${FAKE[@]}" --drift-json "$OUT_DIR/drift.json" \
        --section "$OUT_DIR/probe.md" >"$OUT_DIR/probe.log" 2>&1; then
    PROBE_LINE="see \"### GPU probe\" below"
    [ $DRY = 1 ] && PROBE_LINE="not run on a GPU (dry run): every step ran on the fakes, figures below are the fakes'"
else
    PROBE_LINE="FAILED (exit $?; probe.log)"; PROBE_OK=0
fi
cat "$OUT_DIR/probe.log"
echo "probe: $PROBE_LINE"

echo "== GPU overhead benchmark"
LIMIT=$(step_timeout 150)
if [ "$LIMIT" = 0 ]; then
    OVERHEAD_LINE="not run (time)"; OVERHEAD_OK=0
elif [ $DRY = 1 ]; then
    # Its CPU path: the models and the marked path run two steps, nothing is written.
    if timeout "$LIMIT" "$PY" bench/gpu_overhead.py --no-write >"$OUT_DIR/overhead.log" 2>&1; then
        OVERHEAD_LINE="not run (dry run; its CPU smoke path passed; the CUDA-event agreement gate needs a GPU)"
        OVERHEAD_OK=1
    else
        OVERHEAD_LINE="not run (dry run; its CPU smoke path FAILED: overhead.log)"
        OVERHEAD_OK=0
    fi
else
    timeout "$LIMIT" "$PY" bench/gpu_overhead.py --repeats 7 --steps 20 2>&1 \
        | tee "$OUT_DIR/overhead.log"
    RC=${PIPESTATUS[0]}
    OVERHEAD_OK=$(( RC == 0 ))
    OVERHEAD_LINE="exit $RC; the table below (\"## GPU overhead\")"
fi
tail -3 "$OUT_DIR/overhead.log"
echo "overhead: $OVERHEAD_LINE"

ELAPSED=$(( $(date +%s) - T0 ))
MODE="GPU pass"; [ $DRY = 1 ] && MODE="dry run, no GPU: every GPU part not run"
[ $DRY = 1 ] && NOT_RUN+=("every GPU test (collected only)" "the overhead benchmark on a GPU"
                          "the allocator reads on a GPU" "NVML and CUDA measurements on a device (fakes instead)")
TESTS_TEXT=$(printf '; %s' "${TESTS_LINES[@]}"); TESTS_TEXT=${TESTS_TEXT:2}
NOT_RUN_TEXT="nothing"
[ ${#NOT_RUN[@]} -gt 0 ] && { NOT_RUN_TEXT=$(printf '; %s' "${NOT_RUN[@]}"); NOT_RUN_TEXT=${NOT_RUN_TEXT:2}; }
"$PY" - "$OUT_DIR" "$DRY" <<EOF
import sys
from pathlib import Path
from bench.results import write_section
out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
text = """## GPU pass

\`bash bench/gpu_check.sh$([ $DRY = 1 ] && echo ' --dry-run')\` on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC'), $ELAPSED s ($MODE).

- device: $DEVICE; driver: ${DRIVER:-none}
- packages: $PACKAGES_LINE
- C markers: $BUILD_LINE
- GPU tests (${GPU_TESTS[*]}): $TESTS_TEXT
- host cost of a phase's allocator reads ("bound" peaks): $MEMORY_LINE
- device measurements: $PROBE_LINE
- GPU overhead benchmark: $OVERHEAD_LINE
- not run: $NOT_RUN_TEXT
"""
probe = out / "probe.md"
if probe.exists():
    text += "\n" + probe.read_text()
write_section(text, out / "RESULTS.md")
if not dry:
    write_section(text)  # bench/RESULTS.md of this tree, beside the overhead table
    overhead = (out / "overhead.log").read_text().split("## GPU overhead", 1)
    if len(overhead) == 2:
        write_section("## GPU overhead" + overhead[1].split("\nwrote ", 1)[0], out / "RESULTS.md")
EOF
echo "wrote $OUT_DIR/RESULTS.md ($ELAPSED s)"
if [ "$TESTS_OK" = 1 ] && [ "$OVERHEAD_OK" = 1 ] && [ "$PROBE_OK" = 1 ]; then
    echo "gpu_check: OK ($MODE)"
    exit 0
fi
echo "gpu_check: FAILED (tests: $TESTS_TEXT; probe: $PROBE_LINE; overhead: $OVERHEAD_LINE)" >&2
exit 1
