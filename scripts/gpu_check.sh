#!/usr/bin/env bash
# The GPU checks, in a few minutes on a machine with one CUDA device: the gpu-marked tests
# (GPUPrefetcher: bytes, overlap, memory held, fork safety; DALI mixed decoding), then the
# GPU benchmark (prefetcher vs a plain copy, DALI mixed through shardio vs DALI's reader),
# which writes its section of benchmarks/RESULTS.md. Run from the repository root after
# `make install`; figures land in benchmarks/RESULTS.md and the log in $OUT (or /tmp).
#   scripts/gpu_check.sh            # tests + benchmark
#   GPU_CHECK_FILES=2000 scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOG=${OUT:-/tmp}/gpu_check.log
: > "$LOG"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: torch sees no CUDA device here: nothing to check" | tee -a "$LOG" >&2
    exit 2
fi
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)' | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG" || true
status=0
timeout 600 "$PY" -m pytest -m gpu -q -rs -s -p no:cacheprovider tests/gpu 2>&1 | tee -a "$LOG" || status=$?
timeout 900 "$PY" benchmarks/bench_gpu.py --files "${GPU_CHECK_FILES:-4000}" --repeat 3 2>&1 | tee -a "$LOG" || status=$?
[ -n "${OUT:-}" ] && cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
exit "$status"
