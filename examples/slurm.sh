#!/usr/bin/env bash
# Submit examples/train.py as a SLURM job through scripts/slurm/train_8gpu.sbatch, the job
# template: it stages the dataset to each node's local disk, binds each task to its GPU and
# cores, retries a failed try from the newest checkpoint and cleans up. Edit the values below
# (or set them in the environment), then run it from anywhere:
#
#   examples/slurm.sh                        # submits; extra arguments go to sbatch:
#   examples/slurm.sh --time=08:00:00 --wait
#
# Submitting it again continues from the newest checkpoint in SHARDIO_CKPT_DIR.
set -euo pipefail

# The packed dataset (`shardio pack`), on the parallel filesystem: read-only for the job.
SHARDIO_DATA="${SHARDIO_DATA:-/lustre/proj/imagenet-shards}"
# Checkpoints: on a filesystem every node and the next job see (not node-local disk).
SHARDIO_CKPT_DIR="${SHARDIO_CKPT_DIR:-$PWD/ckpt}"
NODES="${NODES:-1}"                   # start with 1, then 2-4, then full size
TASKS_PER_NODE="${TASKS_PER_NODE:-8}" # one task (rank) per GPU
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"   # 0: CPU-only nodes
CPUS_PER_TASK="${CPUS_PER_TASK:-8}"   # the task's cores: its DataLoader workers run there
WORKERS="${WORKERS:-6}"               # DataLoader workers per task: a core or two fewer
STEPS="${STEPS:-1000}"                # training steps in all (across resubmissions)
BATCH_SIZE="${BATCH_SIZE:-64}"        # per task

# Whole numbers only: they reach sbatch and bash arithmetic.
for name in NODES TASKS_PER_NODE GPUS_PER_NODE CPUS_PER_TASK WORKERS STEPS BATCH_SIZE; do
    if [[ ! "${!name}" =~ ^[0-9]{1,6}$ ]]; then
        echo "slurm.sh: error: $name=${!name:0:40} is not a whole number (ASCII digits)" >&2
        exit 2
    fi
done

# The checkout holding this script: the job runs its scripts/slurm/ and examples/train.py.
SHARDIO_HOME="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$SHARDIO_HOME/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

# Absolute paths: every task of every node resolves them alike. sbatch exports this
# environment to the job; train.py reads SHARDIO_DATA, SHARDIO_STAGE_DIR (set by the job to
# the node's staged copy) and SHARDIO_CKPT_DIR when no option names them.
SHARDIO_DATA="$(realpath -m -- "$SHARDIO_DATA")"
SHARDIO_CKPT_DIR="$(realpath -m -- "$SHARDIO_CKPT_DIR")"
export SHARDIO_DATA SHARDIO_CKPT_DIR SHARDIO_HOME
# Run by bash on every task: quoted with %q, so paths with spaces survive.
TRAIN_CMD="$(printf '%q ' "$PYTHON" "$SHARDIO_HOME/examples/train.py" \
    --steps "$STEPS" --batch-size "$BATCH_SIZE" --workers "$WORKERS")"
export TRAIN_CMD

gres="gpu:$GPUS_PER_NODE"
((GPUS_PER_NODE > 0)) || gres=none
# These options take precedence over the template's #SBATCH lines; "$@" over these.
exec sbatch --nodes="$NODES" --ntasks-per-node="$TASKS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" --gres="$gres" "$@" \
    "$SHARDIO_HOME/scripts/slurm/train_8gpu.sbatch"
