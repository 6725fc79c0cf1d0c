#!/usr/bin/env bash
# Give one SLURM task its own GPU and the CPUs and memory next to it, then exec the command.
#
#   srun --cpu-bind=cores ... scripts/slurm/bind.sh python train.py
#
# Run once per task (under srun). The task's GPU is the SLURM_LOCALID-th visible one. Its NUMA
# node and CPUs come from the same map the loader pins its workers with: `shardio topo --json
# --local-rank $SLURM_LOCALID` (GPUs, their NUMA nodes and the allowed CPUs read from sysfs,
# GPUs in PCI bus order as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them), when shardio is found
# (SHARDIO_BIN, else `shardio` on PATH) and sees an NVIDIA GPU. Otherwise, or when
# SHARDIO_GPU_NUMA_MAP or SHARDIO_NUMA_NODES is given, the node is SHARDIO_GPU_NUMA_MAP[slot]
# when that map is given, else slot * NUMA_NODES / GPUS_PER_NODE, which is right when GPUs
# are spread evenly over NUMA nodes in order (check with `shardio topo` or `nvidia-smi topo
# -m`: on some 8-GPU boards the order is not linear, e.g. "3,3,1,1,7,7,5,5").
#
# Environment (all optional):
#   SHARDIO_BIN            the shardio command (default: shardio on PATH; empty: do not use
#                          it, use the map or the formula)
#   SHARDIO_SYSFS          the sysfs root shardio reads (default /sys)
#   SHARDIO_GPUS_PER_NODE  GPUs per node, for the formula (default 8)
#   SHARDIO_NUMA_NODES     NUMA nodes per node, for the formula (default: counted in /sys,
#                          else 1); given, it selects the formula over `shardio topo`
#   SHARDIO_GPU_NUMA_MAP   comma-separated NUMA node of GPU slot 0, 1, ... (overrides both)
#   SHARDIO_BIND_GPU       1 (default): CUDA_VISIBLE_DEVICES = this task's GPU only, so the
#                          program uses cuda:0; 0: leave every GPU visible (the program calls
#                          torch.cuda.set_device(LOCAL_RANK) itself)
#   SHARDIO_CPU_BIND       numa (default): run on this task's own share of the GPU's NUMA
#                          node and allocate memory there (numactl --physcpubind=<share>
#                          --membind=<node>). The share comes from `shardio topo`: the CPUs
#                          srun gave the node's tasks (the union of SLURM_CPU_BIND_LIST's
#                          masks under --cpu-bind=cores or map_cpu; the task's allowed CPUs
#                          when srun did not bind: --cpu-bind=none, or no task plugin), the
#                          GPU's node's part of them split by whole cores among the local
#                          ranks whose GPUs share that node: co-located ranks never share a
#                          core while there are enough. Without shardio's map (the formula
#                          or SHARDIO_GPU_NUMA_MAP): keep srun's per-task mask when srun
#                          bound the task (memory on the GPU's node only), else the whole
#                          node (numactl --cpunodebind, with a warning when local ranks
#                          share it);
#                          cores: keep srun's --cpu-bind=cores mask, bind memory only
#                          (numactl --membind); none: no CPU or memory binding
#                          Exported to the command: SHARDIO_BOUND_GPU, SHARDIO_BOUND_NUMA_NODE
#                          and SHARDIO_BOUND_CPUS (the task's CPUs: the loader pins its
#                          workers inside them and does not split them again), and
#                          OMP_NUM_THREADS capped at the share's CPU count
#   SHARDIO_NUMACTL        numactl command (default numactl; empty: do not use it)
#   SHARDIO_TASKSET        taskset command, used when numactl is missing (default taskset;
#                          empty: do not use it); its CPUs are the task's share of the node
#                          from `shardio topo`, else the node's cpulist
#   SHARDIO_SYSFS_NODE_DIR where NUMA nodes are listed (default $SHARDIO_SYSFS/devices/system/
#                          node)
#   SHARDIO_BIND_VERBOSE   1: print the binding on stderr
set -euo pipefail

die() {
    echo "bind.sh: error: $*" >&2
    exit 2
}

warn() { echo "bind.sh: warning: $*" >&2; }

# ASCII digits, no sign or leading zero, at most 9 digits (the bracket lists the digits: a
# range such as [0-9] may match other characters in some locales).
is_uint() { [[ "$1" =~ ^(0|[123456789][0123456789]{0,8})$ ]]; }
shown() { # a value as an error message shows it: at most 40 characters
    local v="$1"
    ((${#v} <= 40)) && printf "'%s'" "$v" || printf "'%s'... (%d characters)" "${v:0:40}" "${#v}"
}
# The first line of a regular file (not a FIFO, device or directory: it could block or never
# end), at most 64 KiB; empty when there is none.
read_small() {
    local line=""
    if [[ -f "$1" && -r "$1" ]]; then
        IFS= read -r -n 65536 line <"$1" || true
    fi
    printf '%s' "$line"
}
# This process's CPUs (what srun, or nothing, bound it to), from the kernel.
own_cpus() {
    local key value
    while read -r key value; do
        if [[ "$key" == Cpus_allowed_list: ]]; then
            printf '%s' "$value"
            return
        fi
    done </proc/self/status
}

[[ $# -gt 0 ]] || die "usage: bind.sh COMMAND [ARGS...] (run under srun, one task per GPU)"

if [[ -n "${SLURM_LOCALID+set}" ]]; then
    local_var=SLURM_LOCALID local_id="$SLURM_LOCALID"
elif [[ -n "${LOCAL_RANK+set}" ]]; then
    local_var=LOCAL_RANK local_id="$LOCAL_RANK"
else
    local_var=SLURM_LOCALID local_id=0
fi
is_uint "$local_id" || die "$local_var=$(shown "$local_id") is not a local rank (ASCII digits)"
for var in SLURM_PROCID SLURM_NTASKS; do
    if [[ -n "${!var+set}" ]] && ! is_uint "${!var}"; then
        die "$var=$(shown "${!var}") is not a whole number (ASCII digits)"
    fi
done
gpus_per_node="${SHARDIO_GPUS_PER_NODE:-8}"
if ! is_uint "$gpus_per_node" || ((gpus_per_node == 0 || gpus_per_node > 256)); then
    die "SHARDIO_GPUS_PER_NODE must be a whole number from 1 to 256, got $(shown "$gpus_per_node")"
fi
sysfs_nodes="${SHARDIO_SYSFS_NODE_DIR:-${SHARDIO_SYSFS:-/sys}/devices/system/node}"

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
if ! is_uint "$numa_nodes" || ((numa_nodes == 0 || numa_nodes > 1024)); then
    die "SHARDIO_NUMA_NODES must be a whole number from 1 to 1024, got $(shown "$numa_nodes")"
fi
have() { [[ -n "$1" ]] && command -v "$1" >/dev/null 2>&1; }

# shardio's map, unless a map or a node count is given: the placement of this local rank
# (`shardio topo --json` keeps each placement a flat object, read here without jq).
topo_numa="" topo_cpus="" topo_gpu=""
read -r -a shardio_argv <<<"${SHARDIO_BIN-shardio}"
if [[ -z "${SHARDIO_GPU_NUMA_MAP:-}" && -z "${SHARDIO_NUMA_NODES:-}" ]] &&
    ((${#shardio_argv[@]} > 0)) && have "${shardio_argv[0]}"; then
    if ! topo_json="$("${shardio_argv[@]}" topo --json --local-rank "$local_id" 2>&1)"; then
        # One line (shardio's error is one), then the formula or the map below.
        warn "shardio topo failed, NUMA node by formula: ${topo_json##*$'\n'}"
        topo_json=""
    fi
    entry_re='"placements":[[:space:]]*\[[[:space:]]*\{([^}]*)\}'
    if [[ "$topo_json" =~ $entry_re ]]; then
        entry="${BASH_REMATCH[1]}"
        node_re='"numa_node":[[:space:]]*([0-9]+)'
        cpus_re='"cpus":[[:space:]]*"([0-9,-]+)"'
        gpu_re='"gpu_index":[[:space:]]*([0-9]+)'
        if [[ "$entry" =~ $node_re ]]; then topo_numa="${BASH_REMATCH[1]}"; fi
        if [[ "$entry" =~ $cpus_re ]]; then topo_cpus="${BASH_REMATCH[1]}"; fi
        if [[ "$entry" =~ $gpu_re ]]; then topo_gpu="${BASH_REMATCH[1]}"; fi
    fi
fi
if [[ -n "$topo_numa" && -n "$topo_gpu" ]]; then
    # shardio counted the GPUs in sysfs: its GPU index is the position among the visible ones.
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]]; then
        if ((topo_gpu < ${#visible[@]})); then gpu="${visible[$topo_gpu]}"; fi
    else
        gpu="$topo_gpu"
    fi
    numa="$topo_numa"
    numa_from="shardio topo"
elif [[ -n "${SHARDIO_GPU_NUMA_MAP:-}" ]]; then
    topo_cpus=""
    numa_from=SHARDIO_GPU_NUMA_MAP
    IFS=, read -r -a numa_map <<<"$SHARDIO_GPU_NUMA_MAP"
    ((slot < ${#numa_map[@]})) ||
        die "SHARDIO_GPU_NUMA_MAP has ${#numa_map[@]} entries, GPU slot $slot needs one"
    numa="${numa_map[$slot]}"
    is_uint "$numa" || die "SHARDIO_GPU_NUMA_MAP entry $slot is not a number: $(shown "$numa")"
else
    topo_cpus=""
    numa_from=formula
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

# Did srun bind this task to CPUs of its own (--cpu-bind=cores|threads|map_cpu|mask_cpu: the
# task environment then says mask_cpu or map_cpu)?
srun_bound=0
case ",${SLURM_CPU_BIND_TYPE:-}," in
*,mask_cpu:,* | *,map_cpu:,* | *,mask_cpu,* | *,map_cpu,*) srun_bound=1 ;;
esac

mode="${SHARDIO_CPU_BIND:-numa}"
launcher=()
bound_cpus="" # the CPUs the command runs on, when this script decides them
case "$mode" in
numa)
    if [[ -n "$topo_cpus" ]]; then
        # This task's share of its GPU's node (shardio topo split it among the local ranks).
        bound_cpus="$topo_cpus"
        if have "$numactl_cmd"; then
            launcher=("$numactl_cmd" "--physcpubind=$topo_cpus" "--membind=$numa" --)
        elif have "$taskset_cmd"; then
            launcher=("$taskset_cmd" -c "$topo_cpus") # memory then follows first touch
        else
            bound_cpus=""
        fi
    elif ((srun_bound)); then
        # No map of shardio's to split the node with: srun's own per-task mask, which no two
        # tasks share, with memory on the GPU's node.
        bound_cpus="$(own_cpus)"
        if have "$numactl_cmd"; then
            launcher=("$numactl_cmd" "--membind=$numa" --)
        fi
    else
        if ((gpus_per_node > numa_nodes)); then
            warn "local ranks share NUMA node $numa's CPUs: without a map from shardio the" \
                "node is not split; use srun --cpu-bind=cores or let bind.sh find shardio"
        fi
        if have "$numactl_cmd"; then
            launcher=("$numactl_cmd" "--cpunodebind=$numa" "--membind=$numa" --)
        elif have "$taskset_cmd"; then
            cpus="$(read_small "$sysfs_nodes/node$numa/cpulist")"
            if [[ "$cpus" =~ ^[0123456789,-]+$ ]]; then
                launcher=("$taskset_cmd" -c "$cpus")
            fi
        fi
    fi
    ;;
cores)
    # srun already pinned this task to its cores; only keep its memory on the GPU's node.
    ((srun_bound)) && bound_cpus="$(own_cpus)"
    if have "$numactl_cmd"; then
        launcher=("$numactl_cmd" "--membind=$numa" --)
    fi
    ;;
none) ;;
*) die "SHARDIO_CPU_BIND must be numa, cores or none, got $(shown "$mode")" ;;
esac

if [[ -n "$bound_cpus" ]]; then
    # The loader pins its workers inside these CPUs and does not split them again.
    export SHARDIO_BOUND_CPUS="$bound_cpus"
    ncpus=0
    IFS=, read -r -a ranges <<<"$bound_cpus"
    for r in "${ranges[@]}"; do
        if [[ "$r" =~ ^([0123456789]{1,6})-([0123456789]{1,6})$ ]]; then
            ncpus=$((ncpus + 10#${BASH_REMATCH[2]} - 10#${BASH_REMATCH[1]} + 1))
        elif [[ "$r" =~ ^[0123456789]{1,6}$ ]]; then
            ncpus=$((ncpus + 1))
        fi
    done
    omp="${OMP_NUM_THREADS:-}"
    # Unset, or a plain count above the share's CPUs (a list such as "4,2" is left alone).
    if ((ncpus > 0)) && [[ -z "$omp" ]]; then
        export OMP_NUM_THREADS="$ncpus" # one thread per CPU of the share, not of the node
    elif ((ncpus > 0)) && is_uint "$omp" && ((omp == 0 || omp > ncpus)); then
        export OMP_NUM_THREADS="$ncpus"
    fi
fi

if [[ "${SHARDIO_BIND_VERBOSE:-0}" == 1 ]]; then
    how="${launcher[*]:-no CPU/memory binding}"
    echo "bind.sh: task ${SLURM_PROCID:-?} local $local_id on $(hostname 2>/dev/null || echo ?):" \
        "GPU $gpu, NUMA node $numa of $numa_nodes ($numa_from), CPUs ${bound_cpus:-unchanged}," \
        "$how" >&2
fi
exec "${launcher[@]}" "$@"
