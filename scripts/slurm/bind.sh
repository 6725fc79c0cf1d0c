#!/usr/bin/env bash
# Give one SLURM task its own GPU and the CPUs and memory next to it, then exec the command.
#
#   srun --cpu-bind=cores ... scripts/slurm/bind.sh python train.py
#
# Run once per task (under srun). The task's GPU is picked by SLURM_LOCALID; its NUMA node
# is SHARDIO_GPU_NUMA_MAP[GPU] when that map is given, else GPU * NUMA_NODES / GPUS_PER_NODE,
# which is right when GPUs are spread evenly over NUMA nodes in order (check with
# `nvidia-smi topo -m`: on some 8-GPU boards the order is not linear, e.g. "3,3,1,1,7,7,5,5").
#
# Environment (all optional):
#   SHARDIO_GPUS_PER_NODE  GPUs per node (default 8)
#   SHARDIO_NUMA_NODES     NUMA nodes per node (default: counted in /sys, else 1)
#   SHARDIO_GPU_NUMA_MAP   comma-separated NUMA node of GPU 0, 1, ... (overrides the formula)
#   SHARDIO_BIND_GPU       1 (default): CUDA_VISIBLE_DEVICES = this task's GPU only, so the
#                          program uses cuda:0; 0: leave every GPU visible (the program calls
#                          torch.cuda.set_device(LOCAL_RANK) itself)
#   SHARDIO_CPU_BIND       numa (default): run on every core of the GPU's NUMA node and
#                          allocate memory there (numactl --cpunodebind --membind; replaces
#                          srun's per-task core mask with that node's cores);
#                          cores: keep srun's --cpu-bind=cores mask, bind memory only
#                          (numactl --membind); none: no CPU or memory binding
#   SHARDIO_NUMACTL        numactl command (default numactl; empty: do not use it)
#   SHARDIO_TASKSET        taskset command, used when numactl is missing (default taskset;
#                          empty: do not use it)
#   SHARDIO_SYSFS_NODE_DIR where NUMA nodes are listed (default /sys/devices/system/node)
#   SHARDIO_BIND_VERBOSE   1: print the binding on stderr
set -euo pipefail

die() {
    echo "bind.sh: error: $*" >&2
    exit 2
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

[[ $# -gt 0 ]] || die "usage: bind.sh COMMAND [ARGS...] (run under srun, one task per GPU)"

local_id="${SLURM_LOCALID:-${LOCAL_RANK:-0}}"
is_uint "$local_id" || die "SLURM_LOCALID is not a number: '$local_id'"
gpus_per_node="${SHARDIO_GPUS_PER_NODE:-8}"
if ! is_uint "$gpus_per_node" || ((gpus_per_node == 0)); then
    die "SHARDIO_GPUS_PER_NODE must be a positive integer, got '$gpus_per_node'"
fi
sysfs_nodes="${SHARDIO_SYSFS_NODE_DIR:-/sys/devices/system/node}"

# The GPU: the LOCALID-th entry of what Slurm made visible to the step (its numbering may be
# remapped by cgroups), else the LOCALID-th GPU of the node. More tasks than GPUs wrap around.
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]]; then
    IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
else
    visible=()
    for ((i = 0; i < gpus_per_node; i++)); do visible+=("$i"); done
fi
slot=$((local_id % ${#visible[@]}))
gpu="${visible[$slot]}"

# The NUMA node of that GPU.
if [[ -n "${SHARDIO_NUMA_NODES:-}" ]]; then
    numa_nodes="$SHARDIO_NUMA_NODES"
else
    numa_nodes=0
    for d in "$sysfs_nodes"/node[0-9]*; do
        [[ -d "$d" ]] && numa_nodes=$((numa_nodes + 1))
    done
    ((numa_nodes > 0)) || numa_nodes=1
fi
if ! is_uint "$numa_nodes" || ((numa_nodes == 0)); then
    die "SHARDIO_NUMA_NODES must be a positive integer, got '$numa_nodes'"
fi
if [[ -n "${SHARDIO_GPU_NUMA_MAP:-}" ]]; then
    IFS=, read -r -a numa_map <<<"$SHARDIO_GPU_NUMA_MAP"
    ((slot < ${#numa_map[@]})) ||
        die "SHARDIO_GPU_NUMA_MAP has ${#numa_map[@]} entries, GPU slot $slot needs one"
    numa="${numa_map[$slot]}"
    is_uint "$numa" || die "SHARDIO_GPU_NUMA_MAP entry $slot is not a number: '$numa'"
else
    # Slot, not the GPU id: slot k is the node's k-th GPU even when cgroups renumber them.
    numa=$((slot % gpus_per_node * numa_nodes / gpus_per_node))
fi

if [[ "${SHARDIO_BIND_GPU:-1}" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES="$gpu"
fi
# torch.distributed's names, from SLURM's, for programs that do not read SLURM_* themselves.
export LOCAL_RANK="$local_id"
[[ -n "${SLURM_PROCID:-}" ]] && export RANK="$SLURM_PROCID"
[[ -n "${SLURM_NTASKS:-}" ]] && export WORLD_SIZE="$SLURM_NTASKS"
export SHARDIO_BOUND_GPU="$gpu" SHARDIO_BOUND_NUMA_NODE="$numa"

numactl_cmd="${SHARDIO_NUMACTL-numactl}"
taskset_cmd="${SHARDIO_TASKSET-taskset}"
have() { [[ -n "$1" ]] && command -v "$1" >/dev/null 2>&1; }

mode="${SHARDIO_CPU_BIND:-numa}"
launcher=()
case "$mode" in
numa)
    if have "$numactl_cmd"; then
        launcher=("$numactl_cmd" "--cpunodebind=$numa" "--membind=$numa" --)
    elif have "$taskset_cmd" && [[ -r "$sysfs_nodes/node$numa/cpulist" ]]; then
        # No numactl: pin to the node's cores at least; memory then follows first touch.
        read -r cpus <"$sysfs_nodes/node$numa/cpulist"
        launcher=("$taskset_cmd" -c "$cpus")
    fi
    ;;
cores)
    # srun already pinned this task to its cores; only keep its memory on the GPU's node.
    if have "$numactl_cmd"; then
        launcher=("$numactl_cmd" "--membind=$numa" --)
    fi
    ;;
none) ;;
*) die "SHARDIO_CPU_BIND must be numa, cores or none, got '$mode'" ;;
esac

if [[ "${SHARDIO_BIND_VERBOSE:-0}" == 1 ]]; then
    how="${launcher[*]:-no CPU/memory binding}"
    echo "bind.sh: task ${SLURM_PROCID:-?} local $local_id on $(hostname 2>/dev/null || echo ?):" \
        "GPU $gpu, NUMA node $numa of $numa_nodes, $how" >&2
fi
exec "${launcher[@]}" "$@"
