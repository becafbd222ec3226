"""Past one machine: two torchrun agents as two nodes on loopback, SLURM's variables mapped to a
rank's world, and a sweep submitted through Hydra's submitit launcher (its local executor)."""
import json
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from framework.config.errors import ConfigError
from framework.launch.slurm import job_shape, master_port, node_address, world_from_job
from tests.conftest import ROOT, TORCHRUN, compose_config, run_cli
from tests.reference import reference_training


FAST = ["trainer.progress_bar=false", "trainer.max_steps=4", "logger.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(overrides, out: Path):
    """Two torchrun agents, 2 ranks each, meeting at one c10d rendezvous endpoint: 2 nodes x 2."""
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex
    agents = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "-m", "framework.train", *overrides,
                                f"hydra.run.dir={out}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
              for _ in range(2)]
    try:
        return [(agent.wait(timeout=150), *agent.communicate()) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()


@pytest.mark.integration  # (a torchrun run stays in make test: tests/test_cli.py)
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_train_the_one_process_model_and_tp_across_them_is_refused(tmp_path):
    results = _two_nodes(["mesh=2x2", *FAST], tmp_path / "nodes")
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    two_nodes = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    one_process = reference_training(compose_config(["mesh=1x1", *FAST]))
    assert two_nodes["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    print(f"\ntwo nodes vs one process: losses {two_nodes['losses']} / {one_process['losses']}")
    # mesh=1x4 on 2 nodes x 2 ranks: the TP group [0, 1, 2, 3] would span both nodes.
    results = _two_nodes(["mesh=1x4", *FAST], tmp_path / "across")
    assert all(code != 0 for code, _, _ in results)
    stderr = "".join(err for _, _, err in results)
    assert ("config error: mesh.shape=[1, 4]: TP group [0, 1, 2, 3] spans hosts [0, 1] (2 ranks per host); make the "
            "TP size divide the ranks per host, or set parallel.allow_tp_across_hosts=true") in stderr
    assert not (tmp_path / "across" / "summary.json").exists()


def test_a_slurm_task_joins_its_jobs_world_from_slurms_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm client: gpu007 does not resolve and stays as named
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for key, value in {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "13", "SLURM_NTASKS": "32", "SLURM_JOB_NUM_NODES": "4",
                       "SLURM_NODEID": "1", "SLURM_LOCALID": "5", "SLURM_JOB_NODELIST": "gpu[007-009,012]"}.items():
        monkeypatch.setenv(key, value)
    assert world_from_job() == {"RANK": "13", "WORLD_SIZE": "32", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
                                "MASTER_ADDR": "gpu007", "MASTER_PORT": str(master_port("4242"))}
    assert 20000 <= master_port("4242") < 40000 and master_port("4242") != master_port("4243")


def test_a_node_name_that_does_not_resolve_is_reached_at_the_address_scontrol_gives(monkeypatch, tmp_path):
    scontrol = tmp_path / "scontrol"  # as Slurm's prints a node with several slurmd on one host
    scontrol.write_text("#!/bin/sh\necho \"NodeName=$4 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=host1\"\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert node_address("n1.does-not-resolve.invalid") == "127.0.0.1"
    assert node_address("localhost") == "localhost"  # resolves: scontrol is not asked


def test_each_job_is_sized_from_its_mesh_and_ranks_per_node():
    assert job_shape(compose_config(["mesh.shape=[4,8]", "launcher.ranks_per_node=8"])) == (4, 8)
    assert job_shape(compose_config(["mesh=2x2"])) == (1, 4)  # null: every rank on one node
    with pytest.raises(ConfigError, match=r"launcher.ranks_per_node=3: must divide the mesh size 4 "):
        job_shape(compose_config(["mesh=2x2", "launcher.ranks_per_node=3"]))
    with pytest.raises(ConfigError, match=r"launcher.max_restarts=2: restarts are the self-launcher's .*: set 0, "
                                          r"and continue a failed job with checkpoint.resume="):
        job_shape(compose_config(["mesh=2x2", "launcher.max_restarts=2"]))


@pytest.mark.integration  # (tests/test_slurm.py sweeps through submitit's Slurm launcher in make test)
@pytest.mark.timeout(400)
def test_a_sweep_through_submitit_runs_each_mesh_as_its_own_world(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "hydra/launcher=submitit_local", "mesh=2x1,1x2", *FAST, "launcher.ranks_per_node=2",
                      f"hydra.sweep.dir={sweep}"], timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [s["mesh_shape"] for s in summaries] == [[2, 1], [1, 2]]
    assert summaries[0]["losses"] == pytest.approx(summaries[1]["losses"], rel=1e-5)  # both train the 1x1 model
    # Each job was one submitit job of 1 node x 2 tasks, each task one rank of that job's world.
    for i in range(2):
        assert sorted(p.name for p in (sweep / str(i) / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]


@pytest.mark.timeout(120)
def test_a_sweep_with_a_job_that_cannot_be_sized_is_one_line_and_submits_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "hydra/launcher=submitit_local", "mesh=6x1,2x2", "launcher.ranks_per_node=3", *FAST,
                      f"hydra.sweep.dir={sweep}"], timeout=100)
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("config error: launcher.ranks_per_node=3: must divide the mesh size 4 (mesh.shape=[2, 2]): "
                           "each node runs the same number of ranks (job mesh=2x2 launcher.ranks_per_node=3 "), line
    assert not any(sweep.glob("*/summary.json")) and not (sweep / ".submitit").exists()


@pytest.mark.timeout(120)
def test_submitit_launchers_without_the_extra_say_what_to_install(tmp_path):
    # A hydra_submitit_launcher that cannot be imported, ahead of the installed one.
    fake = tmp_path / "no_plugin" / "hydra_plugins" / "hydra_submitit_launcher"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hydra-submitit-launcher is not installed')\n")
    (fake / "submitit_launcher.py").write_text("raise ImportError('hydra-submitit-launcher is not installed')\n")
    (fake / "config.py").write_text("raise ImportError('hydra-submitit-launcher is not installed')\n")
    result = run_cli(["-m", "hydra/launcher=submitit_slurm", "mesh=1x1", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                     env={"PYTHONPATH": f"{fake.parents[1]}:{ROOT}"}, timeout=100)
    assert result.returncode != 0
    assert "the SLURM launchers need the slurm extra: pip install -e '.[slurm]'" in result.stderr
