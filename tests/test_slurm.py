"""Against a live Slurm: a private two-node cluster on this host (tests/slurm_cluster.py), started
once for this module. Skipped, saying why, where the Slurm binaries are not installed (.ci/run
installs them with apt when it can)."""
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from framework.launch.slurm_watch import watch
from tests.conftest import TEST_MODELS, processes_with_marker, run_cli
from tests.slurm_cluster import missing_binaries, slurm_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400),
              pytest.mark.skipif(missing_binaries() is not None, reason=str(missing_binaries()))]
FAST = ["trainer.progress_bar=false", "logger.tensorboard=false", "trainer.max_steps=6", "trainer.log_every=1"]
SLURM = ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10",
         "launcher.ranks_per_node=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = Path(f"/tmp/fwslurm-{os.getpid()}")  # short: munge's socket path has a length limit
    with slurm_cluster(root, keep_logs=tmp_path_factory.mktemp("slurm-logs")) as env:
        yield env


def squeue(env: dict) -> str:
    return subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %T"], env={**os.environ, **env},
                          capture_output=True, text=True).stdout


@pytest.mark.integration
def test_a_sweep_runs_each_mesh_across_both_nodes_and_trains_what_a_self_launch_trains(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli([*SLURM, "mesh.shape=[2,2],[4,1]", *FAST, f"hydra.sweep.dir={sweep}"], env=cluster, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in (0, 1):  # each job: 2 nodes x 2 tasks
        assert "RUNNING on n[1-2]" in "".join(line for line in result.stderr.splitlines() if f"(job {job}:" in line)
    assert "sacct" not in result.stderr and "Bypassing" not in result.stderr
    reference = run_cli(["mesh=2x2", *FAST, f"hydra.run.dir={tmp_path / 'local'}"], timeout=200)
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = json.loads((tmp_path / "local" / "summary.json").read_text())["losses"]
    for job in (0, 1):
        losses = json.loads((sweep / str(job) / "summary.json").read_text())["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert "2 jobs, 0 failed" in result.stdout


@pytest.mark.integration  # (its failing job waits out Slurm's kill timeout: the longest test)
def test_a_job_whose_rank_fails_is_reported_and_the_other_job_finishes(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli([*SLURM, "mesh=2x2", *FAST, TEST_MODELS, "model._target_=tests.workers.FailOnRank",
                      # job 0's other ranks wait for rank 3 until the collective timeout; job 1 must
                      # not trip a watchdog while 8 ranks share 2 cores
                      "+model.fail_rank=3,99", "trainer.collective_timeout_s=30", "trainer.stall_timeout_s=null",
                      f"hydra.sweep.dir={sweep}"],
                     env=cluster, timeout=380)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "2 jobs, 1 failed" in result.stdout
    # rank 3 raised first (the others time out waiting for it, later): its error is the job's
    assert (sweep / "0" / "error.txt").read_text().startswith(
        "training failed: rank 3 failed: InstantiationException: Error in call to target 'tests.workers.FailOnRank': "
        "RuntimeError('boom on rank 3')")
    assert (sweep / "1" / "summary.json").exists() and not (sweep / "1" / "error.txt").exists()


@pytest.mark.integration
def test_a_cancelled_job_saves_where_it_stopped_is_reported_and_leaves_nothing_running(cluster, tmp_path):
    """scancel signals the job's tasks (SIGTERM): its ranks stop after one step, save, and the
    sweep reports the job as ended before the run finished, naming the checkpoint."""
    sweep, marker = tmp_path / "sweep", f"FRAMEWORK_TEST_MARKER={tmp_path.name}"
    env = {**cluster, "FRAMEWORK_TEST_MARKER": tmp_path.name}
    earlier = {line.split()[0] for line in squeue(cluster).splitlines()}  # an earlier test's jobs are not this one

    def running() -> list:
        return [line.split()[0] for line in squeue(cluster).splitlines()
                if line.endswith(" RUNNING") and line.split()[0] not in earlier]

    command = subprocess.Popen(
        [str(Path(os.sys.executable)), "-m", "framework.train", *SLURM, "mesh=2x1", "trainer.max_steps=100000",
         "trainer.progress_bar=false", "logger.tensorboard=false", "checkpoint.every=100000", TEST_MODELS,
         "model._target_=tests.workers.MarkTraining", f"+model.out={tmp_path}", f"hydra.sweep.dir={sweep}"],
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "training").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        job_id, = running()
        assert len(processes_with_marker(marker)) > 2  # the command and the job's tasks, which inherit it
        subprocess.run(["scancel", job_id], env={**os.environ, **cluster}, check=True)
        stdout, stderr = command.communicate(timeout=120)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, 9)
    assert command.returncode == 1, stderr[-3000:]
    state, line = stderr.strip().splitlines()[-2:]
    assert state.startswith(f"slurm job {job_id} (job 0: launcher.ranks_per_node=2 mesh=2x1 ") and \
        state.endswith("): CANCELLED")
    saved = re.fullmatch(r"slurm job ended CANCELLED before the run finished; checkpoint (\S+) saved at step (\d+)", line)
    assert saved and saved[1] == str(sweep / "0" / "checkpoints" / f"step_{saved[2]}"), line
    assert os.path.isdir(saved[1])
    assert (sweep / "0" / "error.txt").read_text().strip() == line
    assert "1 jobs, 1 failed" in stdout
    time.sleep(3)
    assert processes_with_marker(marker) == []  # the job's tasks inherited the marker (sbatch --export=ALL)


def test_a_job_slurm_can_never_run_is_refused_before_anything_is_submitted(cluster, tmp_path):
    before = squeue(cluster)
    result = run_cli([*SLURM[:2], "hydra.launcher.partition=single", "launcher.ranks_per_node=2", "mesh=2x2", *FAST,
                      f"hydra.sweep.dir={tmp_path / 'sweep'}"], env=cluster, timeout=120)
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("config error: 2 node(s) x 2 task(s) in partition single: Slurm cannot run it: "
                           "allocation failure: Requested node configuration is not available (job launcher.ranks_per_node=2 "
                           "mesh=2x2 "), line
    assert squeue(cluster) == before


def test_a_pending_job_whose_reason_cannot_resolve_is_cancelled_with_one_line(cluster):
    env = {**os.environ, **cluster}
    submitted = subprocess.run(["sbatch", "--parsable", "-p", "single", "-N", "2", "--wrap=true"], env=env,
                               capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip()
    lines = []
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster["SLURM_CONF"]
    try:
        ended = watch({job_id: "by hand"}, say=lines.append, grace_s=2)  # PartitionNodeLimit may also mean down nodes
    finally:
        os.environ.pop("SLURM_CONF") if old is None else os.environ.__setitem__("SLURM_CONF", old)
    # Slurm says PartitionConfig or PartitionNodeLimit (2 nodes asked of a 1-node partition)
    reason = re.fullmatch(rf"slurm job {job_id} \(by hand\): PENDING \((Partition\w+)\)", lines[0]).group(1)
    assert lines[1:] == [f"slurm job {job_id} can never start: pending with reason {reason}; cancelled"]
    assert ended == {job_id: lines[-1]}
    assert f"{job_id} CANCELLED" in squeue(cluster)
