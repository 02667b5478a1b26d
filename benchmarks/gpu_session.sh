#!/bin/bash
# One GPU session in one command (docs/gpu.md, "For the next session with a GPU"): the carried wheels, the GPU
# check, the focused tests, then the suite on CUDA starting where the last run stopped, under one hard time budget.
# Everything lands in $OUT (7 files at most; the device tool brings back 8): session.log (the steps and their exit
# codes), focus.xml, suite.log, suite.xml and check/ (the GPU check's report, picture and trace).
#
#   bash benchmarks/gpu_session.sh                    # from the repository root, with .whl/ beside it
#
# Knobs (seconds unless said): TOTAL_S=540 for the whole script (the machine's start, 1-2 min, comes on top of it);
# GPU_CHECK_S=120 (0: skip the check); FOCUS_S=100; NPROC=14 pytest-xdist workers; FIRST=tests/test_muon.py, the
# file the suite starts from (the 2026-11-26 run stopped before it), then the others in order, wrapping round.
set -u
OUT=${OUT:-gpu-out}
TOTAL_S=${TOTAL_S:-540} GPU_CHECK_S=${GPU_CHECK_S:-120} FOCUS_S=${FOCUS_S:-100} NPROC=${NPROC:-14}
FIRST=${FIRST:-tests/test_muon.py}
FOCUS="tests/test_cuda_memory.py tests/test_gpu_ready.py tests/test_streams.py tests/test_harness.py"
T0=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/session.log"; }
mkdir -p "$OUT/check"
export PYTHONUNBUFFERED=1

# 1. the wheels the machine lacks (expecttest, pytest-repeat; docs/gpu.md says how to fetch them)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "no wheels in .whl/: see docs/gpu.md"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0), torch.cuda.nccl.version())"
  git log -1 --oneline 2>/dev/null; } >>"$OUT/session.log" 2>&1

# 2. the GPU check (world size 1, NCCL): benchmarks/results/<date>-<gpu>.md and its picture, into check/
if [ "$GPU_CHECK_S" -gt 0 ]; then
    timeout -s INT "$GPU_CHECK_S" python3 -m benchmarks.gpu_check --out "$OUT/check" >>"$OUT/session.log" 2>&1
    log "gpu_check rc=$?"
fi

# 3. the focused tests: memory against torch's FSDP2, the harness and its device switch, the streams
export FULLY_SHARD_TEST_DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: the same steps on the CPU (a rehearsal)
timeout -s INT -k 30 "$FOCUS_S" python3 -m pytest -q -p no:cacheprovider --timeout 90 -rfEs \
    --junitxml="$OUT/focus.xml" $FOCUS >>"$OUT/session.log" 2>&1
log "focus rc=$?"

# 4. the suite, from $FIRST on (the part the last run did not reach), then the rest; SIGINT at the end of the
#    budget, so that pytest still prints its summary and writes the XML (it takes seconds to stop the rank pools;
#    killed 45 s later if it has not)
FILES=$(ls tests/test_*.py | sort | awk -v first="$FIRST" -v focus=" $FOCUS " '
    index(focus, " " $0 " ") { next } $0 >= first { print; next } { rest = rest " " $0 } END { print rest }')
BUDGET=$(( $(left) - 50 ))
log "suite: ${BUDGET} s, $NPROC workers, from $FIRST"
timeout -s INT -k 45 "$BUDGET" python3 -m pytest -q -p no:cacheprovider -n "$NPROC" --timeout 150 -rfEs \
    --junitxml="$OUT/suite.xml" $FILES --deselect tests/test_benchmarks_smoke.py::test_quick_benchmark_writes_markdown_and_json \
    >"$OUT/suite.log" 2>&1  # that one is a CPU benchmark of minutes (CI runs it)
log "suite rc=$? ($(tail -n 1 "$OUT/suite.log"))"
