#!/usr/bin/env bash
# Runs the GPU tests (tests/python/gpu) and, with --bench, the CUDA collectives benchmark, on a
# machine with an NVIDIA GPU, CUDA torch and NCCL. Elsewhere those tests skip, saying why.
#
# Usage: scripts/gpu_tests.sh [--wheel WHEEL] [--logs DIR] [--bench] [--max-size SIZE]
#   --wheel  install this ferrovod wheel into a private folder first (machines without Rust:
#            build it elsewhere with scripts/build_wheel.sh); default: the ferrovod the
#            interpreter already imports
#   --logs   folder for pytest's and the benchmark's output (default: a temporary folder)
#   --bench  also run benchmarks/collectives.py --device cuda on 1 rank (beside torch's nccl)
#            and on 2 ranks (staged, beside torch's gloo)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEEL="" LOGS="" BENCH=0 MAX_SIZE="1GiB"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheel) WHEEL="$2"; shift 2 ;;
        --logs) LOGS="$2"; shift 2 ;;
        --bench) BENCH=1; shift ;;
        --max-size) MAX_SIZE="$2"; shift 2 ;;
        *) echo "gpu_tests.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
LOGS="${LOGS:-$(mktemp -d)}"
mkdir -p "$LOGS"

if [[ -n "$WHEEL" ]]; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$WHEEL" || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L || echo "nvidia-smi: not found"
"$PY" - <<'PY' || exit 1
import ferrovod, torch
print("ferrovod", ferrovod.__file__, "| torch", torch.__version__, "| CUDA",
      torch.version.cuda, "| GPUs", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY

status=0
# pytest runs several jobs at once: bound, each job's workers would all take the first cores.
export FERROVOD_BIND_CORES="${FERROVOD_BIND_CORES:-0}"
# Limits (seconds) for the whole test run and for each benchmark run: a device path that hangs
# must not eat a lent machine's time.
PYTHONUNBUFFERED=1 timeout "${GPU_TESTS_LIMIT:-900}" "$PY" -m pytest tests/python/gpu \
    -p no:cacheprovider -rA -q --durations=0 --timeout=400 -n 6 2>&1 | tee "$LOGS/pytest.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

if [[ $BENCH -eq 1 ]]; then
    # One rank: NCCL on the device. Two ranks share the machine's one GPU: staged.
    for np_ in 1 2; do
        FERROVOD_NCCL_DISPATCH=$((np_ == 1 ? 1 : 0)) PYTHONUNBUFFERED=1 timeout "${GPU_BENCH_LIMIT:-600}" "$PY" -m ferrovod.runner.launch \
            -np "$np_" "$PY" benchmarks/collectives.py --device cuda --compare torch \
            --max-size "$MAX_SIZE" 2>&1 | tee "$LOGS/bench_np$np_.log"
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
fi
exit $status
