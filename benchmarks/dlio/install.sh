#!/usr/bin/env bash
# The venv that benchmarks/dlio/run.py runs DLIO (dlio-benchmark 2.0.0) from, with shardio.
#
#   benchmarks/dlio/install.sh [VENV]        (default .venv-dlio in the checkout; idempotent)
#
# dlio-benchmark's declared requirements pull TensorFlow, DALI, torchvision and torchaudio
# (several GB, unused by the PyTorch workloads run here), so it is installed --no-deps beside
# what it imports: pyproject.toml's `dlio` extra. torch==2.13.0 is named in every pip command
# so that no resolution replaces the CPU wheel with another (multi-GB CUDA) build. DLIO still
# imports tensorflow at start-up: run.py puts benchmarks/dlio/stub (a stand-in that fails on
# any use) first on DLIO's PYTHONPATH. shardio is installed editable from this checkout.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${1:-$REPO/.venv-dlio}
TORCH=torch==2.13.0
PY=${PYTHON:-python3.11}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)

"${pip[@]}" "$TORCH"
"${pip[@]}" --no-deps dlio-benchmark==2.0.0 "$TORCH"
# The `dlio` extra, read from pyproject.toml (one list to keep), and shardio's own runtime
# dependencies; then shardio itself, without resolving anything again.
mapfile -t EXTRA < <("$VENV/bin/python" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["optional-dependencies"]["dlio"] + project["dependencies"]))
PY
)
"${pip[@]}" "$TORCH" "${EXTRA[@]}"
"${pip[@]}" --no-deps -e "$REPO" "$TORCH"

# The check that it all imports as run.py will run it (TensorFlow stubbed).
PYTHONPATH="$REPO/benchmarks/dlio/stub:$REPO/benchmarks/dlio" "$VENV/bin/python" -c '
import dlio_benchmark.main, mpi4py.MPI, torch, shardio_reader
from importlib.metadata import version
print("dlio-benchmark", version("dlio_benchmark"), "torch", torch.__version__,
      "shardio", version("shardio-hpc"))'
[ -x "$VENV/bin/mpirun" ] || { echo "install.sh: $VENV/bin/mpirun missing" >&2; exit 1; }
echo "ready: $VENV"
