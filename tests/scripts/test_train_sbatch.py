"""scripts/slurm/train_8gpu.sbatch and bind.sh, run with bash and fake srun/scontrol/numactl.

The fake srun runs each step's command once, as task 0 of node 0, so the dry run stages a
real tiny dataset, "trains" with a command that records what it sees, and cleans up.

The job itself runs under real sbatch/srun in tests/slurm/test_slurm_train_sbatch.py (stage,
bind, a failed try retried, give-up, USR1, clean). The fakes remain for what this machine's
cluster cannot be: nodes of 8 GPUs and 8-core tasks (the exact srun lines of that layout),
several NUMA nodes and numactl (not installed here), and job states that are hard to reach
for real (a planted staging directory, a damaged source during a job, checkpoints, odd
SLURM_* values).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from fakebins import JOB_TOOLS, fake_files, fake_path

REPO = pathlib.Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "scripts" / "slurm"
SBATCH = SLURM_DIR / "train_8gpu.sbatch"
BIND = SLURM_DIR / "bind.sh"
SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
SCRIPTS = [
    SBATCH,
    BIND,
    SLURM_DIR / "retry_srun.sh",
    SLURM_DIR / "cluster.sh",
    REPO / "scripts" / "beeond" / "beeond_stage.sh",
]
FAKES = fake_files()
JOB_FAKES = fake_path(*JOB_TOOLS)


def sbatch_options(path: pathlib.Path) -> dict[str, str]:
    """The #SBATCH lines of a job script, before its first command, as {option: value}."""
    options: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            break  # sbatch stops reading #SBATCH lines at the first command
        match = re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line)
        if match:
            options[match.group(1)] = match.group(2) or ""
    return options


def test_sbatch_header_asks_for_8_gpu_nodes() -> None:
    options = sbatch_options(SBATCH)
    assert options["--gres"] == "gpu:8"
    assert options["--ntasks-per-node"] == "8"
    assert options["--cpus-per-task"] == "8"
    assert options["--hint"] == "nomultithread"
    assert "--exclusive" in options
    assert re.fullmatch(r"\d+:\d\d:\d\d", options["--time"])
    assert options["--nodes"].isdigit()
    assert options["--signal"].startswith("B:USR1@")  # the epilogue's time before the limit
    assert SBATCH.read_text().startswith("#!/usr/bin/env bash\n")


def test_sbatch_exports_threads_and_binds_cores() -> None:
    text = SBATCH.read_text()
    assert 'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-8}"' in text
    assert "--cpu-bind=cores" in text
    assert "set -euo pipefail" in text
    assert "trap epilogue EXIT" in text


@pytest.mark.parametrize("path", SCRIPTS + FAKES, ids=lambda p: p.name)
def test_bash_syntax(path: pathlib.Path) -> None:
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SCRIPTS + [p for p in FAKES if not p.name.startswith("_")])
def test_executable(path: pathlib.Path) -> None:
    assert os.access(path, os.X_OK), f"chmod +x {path}"


# --- bind.sh ----------------------------------------------------------------------------------


@pytest.fixture
def probe(tmp_path: pathlib.Path) -> pathlib.Path:
    """A command that writes the binding it got (GPU, ranks) to probe.out."""
    return tmp_path / "probe.out"


def probe_cmd(out: pathlib.Path) -> list[str]:
    return [
        "bash",
        "-c",
        f'echo "$CUDA_VISIBLE_DEVICES $LOCAL_RANK ${{RANK:-}} $SHARDIO_BOUND_NUMA_NODE" > {out}',
    ]


@pytest.mark.parametrize(
    ("numa_nodes", "expected_numa"), [("2", "0"), ("4", "1"), ("8", "3"), ("1", "0")]
)
def test_bind_localid_3_gets_gpu_3_and_its_numa_node(
    run_script: Callable[..., Any], probe: pathlib.Path, numa_nodes: str, expected_numa: str
) -> None:
    env = {"SLURM_LOCALID": "3", "SLURM_PROCID": "11", "SHARDIO_NUMA_NODES": numa_nodes}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    n = expected_numa
    assert result.calls == [
        ["numactl", f"--cpunodebind={n}", f"--membind={n}", "--", *probe_cmd(probe)]
    ]
    assert probe.read_text().split() == ["3", "3", "11", n]


def test_bind_uses_the_gpu_numa_map(run_script: Callable[..., Any], probe: pathlib.Path) -> None:
    env = {"SLURM_LOCALID": "3", "SHARDIO_GPU_NUMA_MAP": "3,3,1,1,7,7,5,5"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls[0][:3] == ["numactl", "--cpunodebind=1", "--membind=1"]


def test_bind_picks_from_the_gpus_slurm_made_visible(
    run_script: Callable[..., Any], probe: pathlib.Path
) -> None:
    env = {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "4,6", "SHARDIO_NUMA_NODES": "2"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert probe.read_text().split()[0] == "6"


def test_bind_cores_mode_binds_memory_only(
    run_script: Callable[..., Any], probe: pathlib.Path
) -> None:
    env = {"SLURM_LOCALID": "5", "SHARDIO_NUMA_NODES": "2", "SHARDIO_CPU_BIND": "cores"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [["numactl", "--membind=1", "--", *probe_cmd(probe)]]


def test_bind_falls_back_to_taskset_then_to_plain_exec(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    sysfs = tmp_path / "sysfs-node"
    for node, cpus in (("node0", "0-31"), ("node1", "32-63")):
        (sysfs / node).mkdir(parents=True)
        (sysfs / node / "cpulist").write_text(cpus + "\n")
    no_gpu = tmp_path / "sysfs-no-gpu"  # `shardio topo` finds no GPU there: the formula
    no_gpu.mkdir()
    env = {
        "SLURM_LOCALID": "6",
        "SHARDIO_NUMACTL": "",
        "SHARDIO_SYSFS_NODE_DIR": str(sysfs),
        "SHARDIO_SYSFS": str(no_gpu),
    }
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [["taskset", "-c", "32-63", *probe_cmd(probe)]]  # 2 nodes counted
    assert probe.read_text().split()[0] == "6"

    probe.unlink()
    result = run_script([BIND, *probe_cmd(probe)], env=env | {"SHARDIO_TASKSET": ""})
    assert result.rc == 0, result.stderr
    assert len(result.calls) == 1  # nothing new recorded: plain exec
    assert probe.read_text().split()[:2] == ["6", "6"]


def test_bind_can_leave_every_gpu_visible(
    run_script: Callable[..., Any], probe: pathlib.Path
) -> None:
    env = {"SLURM_LOCALID": "2", "SHARDIO_BIND_GPU": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    result = run_script([BIND, *probe_cmd(probe)], env=env | {"SHARDIO_CPU_BIND": "none"})
    assert result.rc == 0, result.stderr
    assert result.calls == []
    assert probe.read_text().split()[:2] == ["0,1,2,3", "2"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not a local rank"),
        ({"SHARDIO_NUMA_NODES": "0"}, "SHARDIO_NUMA_NODES must be"),
        ({"SHARDIO_GPU_NUMA_MAP": "0,1", "SLURM_LOCALID": "3"}, "has 2 entries"),
        ({"SHARDIO_CPU_BIND": "sockets"}, "must be numa, cores or none"),
    ],
)
def test_bind_rejects_bad_settings(
    run_script: Callable[..., Any], env: dict[str, str], message: str
) -> None:
    result = run_script([BIND, "true"], env=env)
    assert result.rc == 2
    assert message in result.stderr


# --- the job script, run with bash --------------------------------------------------------------


JOB_ID = "777"


def private_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """The job's private staging directory under the fake node-local scratch (SLURM_TMPDIR)."""
    return tmp_path / "nvme" / f"shardio-{os.getuid()}-{JOB_ID}"


def default_area(tmp_path: pathlib.Path, src: str | os.PathLike[str]) -> pathlib.Path:
    """Where `shardio stage` stages ``src`` by default: ``<name>-<hash>`` in the private
    directory (the name from abspath, the hash from realpath: shardio.staging's rule)."""
    name = os.path.basename(os.path.abspath(src))
    digest = hashlib.sha256(os.fsencode(os.path.realpath(src))).hexdigest()[:8]
    return private_dir(tmp_path) / f"{name}-{digest}"


@pytest.fixture
def job_env(tmp_path: pathlib.Path, tiny_dataset: pathlib.Path) -> dict[str, str]:
    """What sbatch would set for a 1-node job of 8 tasks, plus shardio's settings."""
    (tmp_path / "nvme").mkdir()  # the node-local scratch that SLURM_TMPDIR names
    return {
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_NNODES": "1",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_CPUS_PER_TASK": "8",
        "SLURM_JOB_NODELIST": "gpu[07]",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SHARDIO_FAKE_HOSTS": "gpu07",
        "SHARDIO_DATA": str(tiny_dataset),
        "SHARDIO_BIN": str(SHARDIO),
        "SHARDIO_NUMA_NODES": "2",
        "SLURM_TMPDIR": str(tmp_path / "nvme"),
        "RETRY_SRUN_BACKOFF_S": "0",
    }


def steps(calls: list[list[str]]) -> list[str]:
    """srun calls named by what they run: stage, train or clean."""
    out = []
    for call in calls:
        if call[0] != "srun":
            continue
        if str(BIND) in call:
            out.append("train")
        elif "shardio-clean" in call:
            out.append("clean")
        elif "shardio-repair" in call:
            out.append("repair")
        elif "stage" in call:
            out.append("stage")
        else:
            out.append("?")
    return out


def test_dry_run_stages_trains_and_cleans(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    stage_dir = default_area(tmp_path, tiny_dataset)
    seen = tmp_path / "seen.txt"
    train = (
        'test -e "$SHARDIO_STAGE_DIR/manifest.json" && echo "$CUDA_VISIBLE_DEVICES $OMP_NUM_THREADS'
        f' $MASTER_ADDR $SHARDIO_STAGE_DIR $SHARDIO_BOUND_NUMA_NODE $WORLD_SIZE" > {seen}'
    )
    env = job_env | {"TRAIN_CMD": train, "SLURM_NTASKS": "8"}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 0, result.stderr
    assert steps(result.calls) == ["stage", "train", "clean"]
    stage, train_call, clean = (c for c in result.calls if c[0] == "srun")
    # No DEST: shardio picks (and checks) the job's private area on each node.
    assert stage == [
        "srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=8",
        "--kill-on-bad-exit=1", str(SHARDIO), "stage", str(tiny_dataset),
        "--node", "auto", "--ranks-per-node", "8", "--no-progress",
    ]  # fmt: skip
    assert train_call[:8] == [
        "srun", "--nodes=1", "--ntasks-per-node=8", "--cpus-per-task=8", "--cpu-bind=cores",
        "--threads-per-core=1", "--distribution=block:block", "--kill-on-bad-exit=1",
    ]  # fmt: skip
    assert train_call[8:] == [str(BIND), "bash", "-c", train]
    assert clean[:6] == stage[:6]
    assert clean[-3:] == [str(stage_dir), str(private_dir(tmp_path)), str(SHARDIO)]
    # srun bound the task (the fake reports --cpu-bind=cores as srun does) and this machine
    # has no GPU for shardio's map: bind.sh keeps srun's mask and binds memory only.
    assert ["numactl", "--membind=0", "--", "bash", "-c", train] in result.calls
    # The training command saw the staged copy, its GPU, its threads (no more than its CPUs)
    # and the rendezvous.
    gpu, omp, master, cache, numa, world = seen.read_text().split()
    threads = str(min(8, len(os.sched_getaffinity(0))))
    assert (gpu, omp, master, cache, numa, world) == (
        "0", threads, "gpu07", str(stage_dir), "0", "8"
    )  # fmt: skip
    assert not stage_dir.exists()  # the epilogue removed it
    assert not private_dir(tmp_path).exists()  # and the job's private directory
    assert sorted(os.listdir(tmp_path / "nvme")) == []
    assert "training finished with exit 0" in result.stderr
    assert "warning" not in result.stderr


def test_the_default_training_is_examples_train_py(
    run_script: Callable[..., Any], job_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    # A checkout whose examples/train.py records that it ran, and with what.
    home = tmp_path / "my checkout"  # a space: the default command quotes the path
    (home / "examples").mkdir(parents=True)
    (home / "scripts").symlink_to(REPO / "scripts")
    ran = tmp_path / "ran.txt"
    (home / "examples" / "train.py").write_text(
        f"import os; open({str(ran)!r}, 'w').write(os.environ['SHARDIO_DATA'])\n"
    )
    result = run_script(["bash", SBATCH], env=job_env | {"SHARDIO_HOME": str(home)})
    assert result.rc == 0, result.stderr
    (train_call,) = (c for c in result.calls if c[0] == "srun" and c[-3] == "bash")
    assert train_call[-2:] == ["-c", 'python "$SHARDIO_HOME/examples/train.py"']
    assert ran.read_text() == job_env["SHARDIO_DATA"]
    assert 'GPUs: python "$SHARDIO_HOME/examples/train.py"' in result.stderr


def test_each_try_resumes_from_the_newest_intact_checkpoint(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    tmp_path: pathlib.Path,
) -> None:
    ckdir = tmp_path / "ckpt"
    seen = tmp_path / "resumed.txt"
    save = (
        f"{sys.executable} -c 'from shardio.checkpoint import save; "
        f'save({{"w": 1}}, "{ckdir}", step=7)\''
    )
    train = f'echo "[$SHARDIO_RESUME_FROM]" >> {seen}; {save}; exit 4'
    env = job_env | {"TRAIN_CMD": train, "SHARDIO_TRIES": "2", "SHARDIO_VERIFY_QUICK": "1",
                     "SHARDIO_CKPT_DIR": str(ckdir)}  # fmt: skip
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 4, result.stderr
    (saved,) = ckdir.glob(f"checkpoint_*_{JOB_ID}_full_step000000000000007")
    assert seen.read_text().split() == ["[]", f"[{saved}]"]
    assert f"try 1 starts from scratch: no checkpoint in {ckdir} yet" in result.stderr
    assert f"try 2 resumes from checkpoint {saved}" in result.stderr


def test_failed_staging_stops_before_training_and_cleans(
    run_script: Callable[..., Any], job_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    env = job_env | {"SHARDIO_DATA": str(tmp_path / "missing-ds")}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc != 0
    # The repair step finds no staging area to repair: the job ends, whatever the policy.
    assert steps(result.calls) == ["stage", "repair", "clean"]
    assert "shardio: error:" in result.stderr
    assert "shardio-repair: no staging area at" in result.stderr
    assert "no staging area could be checked or repaired" in result.stderr

    result = run_script(["bash", SBATCH], env=env | {"SHARDIO_POLICY": "skip"})
    assert result.rc != 0
    assert steps(result.calls)[-3:] == ["stage", "repair", "clean"]


@pytest.fixture
def bad_source(tiny_dataset: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the tiny dataset with one damaged shard (a flipped payload byte)."""
    data = tmp_path / "data" / "tiny-ds"
    shutil.copytree(tiny_dataset, data)
    shard = sorted(data.glob("shards/*.tar"))[1]
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 0xFF  # inside the first member's payload
    shard.write_bytes(bytes(raw))
    return data


def test_a_damaged_source_shard_stops_the_job_under_policy_raise(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    bad_source: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    env = job_env | {"SHARDIO_DATA": str(bad_source), "TRAIN_CMD": "true"}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc != 0
    assert steps(result.calls) == ["stage", "repair", "clean"]
    repair = next(c for c in result.calls if "shardio-repair" in c)
    assert "--kill-on-bad-exit=0" in repair  # one node's outcome stops no other's repair
    area = default_area(tmp_path, bad_source)
    assert repair[-3:] == [str(area), str(private_dir(tmp_path)), str(SHARDIO)]
    assert "staging failed (exit" in result.stderr
    assert "could not repair shards/" in result.stderr  # shardio's own report, per node
    assert "error: damage is left after the repair" in result.stderr
    assert "set SHARDIO_POLICY=skip to train anyway" in result.stderr
    assert not private_dir(tmp_path).exists()


def test_a_damaged_source_shard_is_skipped_under_policy_skip(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    bad_source: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    """The stage step aborts on the bad shard; the repair stages every other one; training
    starts with a warning and finds every good shard staged."""
    seen = tmp_path / "seen.txt"
    train = (
        f'echo "$SHARDIO_POLICY" > {seen}; '
        f'"$SHARDIO_BIN" verify --json --no-progress "$SHARDIO_STAGE_DIR" >> {seen} || true'
    )
    env = job_env | {"SHARDIO_DATA": str(bad_source), "TRAIN_CMD": train}
    result = run_script(["bash", SBATCH], env=env | {"SHARDIO_POLICY": "skip"})
    assert result.rc == 0, result.stderr
    assert steps(result.calls) == ["stage", "repair", "train", "clean"]
    assert "warning: damage is left after the repair" in result.stderr
    assert "SHARDIO_POLICY=skip: training starts anyway" in result.stderr
    policy, report = seen.read_text().split("\n", 1)
    assert policy == "skip"
    found = json.loads(report)
    bad = sorted(bad_source.glob("shards/*.tar"))[1].relative_to(bad_source).as_posix()
    # Training saw every shard staged but the bad one, and verify says the source is bad.
    assert [p["shard"] for p in found["problems"]] == [bad]
    assert found["status"] == "degraded"  # a same-size flip passes the quick source check
    assert not private_dir(tmp_path).exists()


def test_a_policy_that_is_neither_raise_nor_skip_is_refused(
    run_script: Callable[..., Any], job_env: dict[str, str]
) -> None:
    result = run_script(["bash", SBATCH], env=job_env | {"SHARDIO_POLICY": "ignore"})
    assert result.rc == 2
    assert "SHARDIO_POLICY must be raise or skip, not 'ignore'" in result.stderr
    assert result.calls == []


def test_a_dataset_damaged_during_training_is_repaired_from_the_repair_source(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    data = tmp_path / "data" / "tiny-ds"
    shutil.copytree(tiny_dataset, data)
    shard = sorted(data.glob("shards/*.tar"))[0]
    marker = tmp_path / "damaged-once"
    # The first try damages a shard of SHARDIO_DATA (a payload byte) and fails.
    train = (
        f"if [ ! -e {marker} ]; then touch {marker}; "
        f'printf "\\377" | dd of={shard} bs=1 seek=700 conv=notrunc status=none; exit 4; fi'
    )
    env = job_env | {
        "SHARDIO_DATA": str(data),
        "TRAIN_CMD": train,
        "SHARDIO_REPAIR_SOURCE": str(tiny_dataset),
    }
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 0, result.stderr
    assert steps(result.calls) == ["stage", "train", "stage", "train", "clean"]
    assert f"repairing {data}: " in result.stderr
    assert f"--source {tiny_dataset}" in result.stderr
    assert f"dataset {data} repaired" in result.stderr
    assert shard.read_bytes() == (tiny_dataset / shard.relative_to(data)).read_bytes()


def test_stage_with_make(
    run_script: Callable[..., Any], job_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    # The Makefile's stage-nvme depends on `install`; give it a stand-in `make` that records.
    fake_make = tmp_path / "bin" / "make"
    fake_make.parent.mkdir()
    fake_make.write_text(
        "#!/usr/bin/env bash\n"
        'line=make; for a in "$@"; do line+=$\'\\t\'"$a"; done\n'
        'printf \'%s\\n\' "$line" >>"$SHARDIO_FAKE_LOG"\n'
    )
    fake_make.chmod(0o755)
    env = job_env | {
        "SHARDIO_STAGE_WITH": "make",
        "SHARDIO_STAGE_ARGS": "--capacity 1GiB",
        "TRAIN_CMD": "true",
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{JOB_FAKES}{os.pathsep}{os.environ['PATH']}",
    }
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 0, result.stderr
    make = next(c for c in result.calls if c[0] == "make")
    assert make == [
        "make", "-s", "-C", str(REPO), "stage-nvme", f"SHARDIO_DATA={job_env['SHARDIO_DATA']}",
        "SHARDIO_STAGE_DIR=",  # empty: the target gives shardio no DEST, shardio picks
        "SHARDIO_STAGE_ARGS=--ranks-per-node 8 --no-progress --capacity 1GiB",
    ]  # fmt: skip
    # The stand-in staged nothing: the job says that training will not find the area.
    area = default_area(tmp_path, job_env["SHARDIO_DATA"])
    assert f"warning: no staging area at {area}" in result.stderr

    mine = tmp_path / "my-area"
    result = run_script(["bash", SBATCH], env=env | {"SHARDIO_STAGE_DIR": str(mine)})
    assert result.rc == 0, result.stderr
    make = [c for c in result.calls if c[0] == "make"][-1]
    assert make[6] == f"SHARDIO_STAGE_DIR={mine}"
    assert "warning" not in result.stderr


@pytest.mark.parametrize(
    ("drop", "message"),
    [("SHARDIO_DATA", "set SHARDIO_DATA"), ("SLURM_JOB_ID", "not inside a SLURM job")],
)
def test_job_script_needs_its_settings(
    run_script: Callable[..., Any], job_env: dict[str, str], drop: str, message: str
) -> None:
    env = job_env | {drop: ""}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 2
    assert message in result.stderr
    assert result.calls == []


# --- the staging area: private to the user and the job ------------------------------------------


def snapshot(root: pathlib.Path) -> dict[str, tuple[int, bytes | str]]:
    """Everything under root (root included) without following a symlink: rel -> (mode, data)."""
    out: dict[str, tuple[int, bytes | str]] = {}
    paths = [root] if root.is_symlink() else [root, *root.rglob("*")]
    for path in paths:
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = (st.st_mode, os.readlink(path))
        elif path.is_file():
            out[rel] = (st.st_mode, path.read_bytes())
        else:
            out[rel] = (st.st_mode, "")
    return out


def test_default_area_is_private_to_the_user_and_job(
    run_script: Callable[..., Any], job_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    seen = tmp_path / "seen.txt"
    train = f'stat -c "%a %u" "$(dirname "$SHARDIO_STAGE_DIR")" > {seen}'
    result = run_script(["bash", SBATCH], env=job_env | {"TRAIN_CMD": train})
    assert result.rc == 0, result.stderr
    assert seen.read_text().split() == ["700", str(os.getuid())]
    area = default_area(tmp_path, job_env["SHARDIO_DATA"])
    assert f"staging {job_env['SHARDIO_DATA']} to {area}" in result.stderr
    assert not private_dir(tmp_path).exists()


@pytest.mark.parametrize("spelling", ["trailing-slash", "dot-dot", "symlink"])
def test_default_area_is_where_shardio_stages(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
    spelling: str,
) -> None:
    """However SHARDIO_DATA is spelled, training is told the area shardio picked."""
    name = "tiny-ds"
    if spelling == "trailing-slash":
        data = f"{tiny_dataset}/"
    elif spelling == "dot-dot":
        data = f"{tiny_dataset}/./shards/../"
    else:
        name = "linked-ds"
        (tmp_path / name).symlink_to(tiny_dataset)  # abspath, not realpath: the link's name
        data = str(tmp_path / name)
    seen = tmp_path / "seen.txt"
    train = f'test -f "$SHARDIO_STAGE_DIR/manifest.json" && echo "$SHARDIO_STAGE_DIR" > {seen}'
    result = run_script(["bash", SBATCH], env=job_env | {"SHARDIO_DATA": data, "TRAIN_CMD": train})
    assert result.rc == 0, result.stderr
    assert seen.read_text().strip() == str(default_area(tmp_path, data))
    assert pathlib.Path(seen.read_text().strip()).name.startswith(f"{name}-")
    assert "warning" not in result.stderr


@pytest.mark.parametrize("trap", ["symlink", "writable-by-others", "another-users"])
def test_a_planted_private_directory_is_refused_and_left_alone(
    run_script: Callable[..., Any], job_env: dict[str, str], tmp_path: pathlib.Path, trap: str
) -> None:
    """Another user of a shared $TMPDIR made shardio-<uid>-<job> first: nothing is staged
    into it, training does not start, and the epilogue does not touch it."""
    private = private_dir(tmp_path)
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "tiny-ds").mkdir()
    (planted / "tiny-ds" / "theirs.txt").write_bytes(b"not yours")
    if trap == "symlink":
        private.symlink_to(planted)
    else:
        shutil.copytree(planted, private, symlinks=True)
        private.chmod(0o777)
        if trap == "another-users":
            if os.getuid() != 0:
                pytest.skip("making a directory of another user needs root")
            private.chmod(0o755)
            for path in [private, *private.rglob("*")]:
                os.lchown(path, 4242, 4242)
    before, planted_before = snapshot(private), snapshot(planted)
    env = job_env | {"TRAIN_CMD": "true", "SHARDIO_POLICY": "skip"}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc != 0
    # The repair step leaves it alone too, and even skip does not train from it.
    assert steps(result.calls) == ["stage", "repair", "clean"]
    assert "shardio: error:" in result.stderr
    assert f"staging directory {private}" in result.stderr
    assert "another user could control it" in result.stderr
    assert f"shardio-repair: {private} is not private to you: left alone" in result.stderr
    assert f"shardio-clean: {private} is not private to you: left alone" in result.stderr
    assert snapshot(private) == before
    assert snapshot(planted) == planted_before


def test_a_given_stage_dir_is_used_as_given(
    run_script: Callable[..., Any],
    job_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    mine = tmp_path / "scratch" / "area"
    env = job_env | {"SHARDIO_STAGE_DIR": str(mine), "TRAIN_CMD": "true"}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 0, result.stderr
    assert steps(result.calls) == ["stage", "train", "clean"]
    stage, _, clean = (c for c in result.calls if c[0] == "srun")
    assert stage[6:10] == [str(SHARDIO), "stage", str(tiny_dataset), str(mine)]
    assert clean[-3:] == [str(mine), "", str(SHARDIO)]
    assert not mine.exists() and (tmp_path / "scratch").is_dir()  # only the area is removed
    assert not private_dir(tmp_path).exists()


def test_a_job_id_that_is_no_file_name_is_refused(
    run_script: Callable[..., Any], job_env: dict[str, str]
) -> None:
    result = run_script(["bash", SBATCH], env=job_env | {"SLURM_JOB_ID": "../777"})
    assert result.rc == 2
    assert "SLURM_JOB_ID '../777' is not a job id: set SHARDIO_STAGE_DIR" in result.stderr
    assert result.calls == []


@pytest.mark.parametrize("value", ["\u00b2", "8x", "-8", "0", "1" * 5000, "8(x2"])
def test_a_malformed_tasks_per_node_stops_the_job_before_any_step(
    run_script: Callable[..., Any], job_env: dict[str, str], value: str
) -> None:
    result = run_script(["bash", SBATCH], env=job_env | {"SLURM_NTASKS_PER_NODE": value})
    assert result.rc == 2
    assert "error: SLURM_NTASKS_PER_NODE=" in result.stderr
    assert len(result.stderr) < 400
    assert not any(c[0] == "srun" for c in result.calls)


def test_slurm_s_per_node_list_gives_the_ranks_per_node(
    run_script: Callable[..., Any], job_env: dict[str, str]
) -> None:
    env = job_env | {"SLURM_NTASKS_PER_NODE": "4(x1)", "TRAIN_CMD": "true"}
    result = run_script(["bash", SBATCH], env=env)
    assert result.rc == 0, result.stderr
    train = next(c for c in result.calls if c[0] == "srun" and "--cpu-bind=cores" in c)
    assert "--ntasks-per-node=4" in train
