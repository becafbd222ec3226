"""Threads per rank: this host's cores shared out among its ranks unless the user says otherwise,
read back from torch inside the ranks (whatever machine runs the suite); and each rank bound to
its share of the cores, read back from the kernel's affinity inside the ranks."""
import json
import os

import pytest

from framework.launch.threads import binds_cores, cores_of_rank, threads_per_rank
from tests.conftest import TEST_MODELS, TORCHRUN, compose_config, run_cli

ALL_CORES = sorted(os.sched_getaffinity(0))
CORES = len(ALL_CORES)
REPORT = [TEST_MODELS, "model._target_=tests.workers.ReportThreads",
          "trainer.max_steps=1", "trainer.progress_bar=false", "logger.tensorboard=false"]


def ranks_of(mesh: str) -> int:
    ranks = 1
    for size in mesh.split("x"):
        ranks *= int(size)
    return ranks


def threads_in_ranks(tmp_path, mesh: str, *overrides: str, omp: str | None = None, prefix=()) -> dict:
    result = run_cli([*REPORT, f"+model.out={tmp_path}", f"mesh={mesh}", *overrides,
                      f"hydra.run.dir={tmp_path / 'job'}"], env={"OMP_NUM_THREADS": omp}, timeout=120, prefix=prefix)
    assert result.returncode == 0, result.stderr
    ranks = ranks_of(mesh)
    threads = {rank: int((tmp_path / f"threads.rank{rank}").read_text()) for rank in range(ranks)}
    assert f"{ranks} rank{'s' if ranks > 1 else ''} on {CORES} cores: {threads[0]} thread" in result.stdout
    return threads


def cores_in_ranks(tmp_path, ranks: int) -> dict:
    return {rank: json.loads((tmp_path / f"cores.rank{rank}").read_text()) for rank in range(ranks)}


def assert_shared_out(cores: dict, threads: int) -> None:
    """Each rank on `threads` cores; consecutive ranks on different ones until the host's cores are
    used up, and every core carrying as many ranks as any other."""
    assert all(len(mine) == threads for mine in cores.values()), cores
    ranks = len(cores)
    for rank in range(min(ranks, CORES // threads)):
        for other in range(rank):
            assert not set(cores[rank]) & set(cores[other]), cores
    load = [sum(core in mine for mine in cores.values()) for core in ALL_CORES]
    if ranks * threads % CORES == 0:
        assert set(load) == {ranks * threads // CORES}, cores


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mesh,plan", [pytest.param("1x1", "plan=none", marks=pytest.mark.integration),
                                       ("2x2", "plan=seed_mlp_tp")])
def test_each_rank_gets_its_share_of_the_cores_and_is_bound_to_them(mesh, plan, tmp_path):
    threads = threads_in_ranks(tmp_path, mesh, plan, "launcher.bind_cores=true")
    ranks = len(threads)
    assert set(threads.values()) == {max(1, CORES // ranks)}
    assert_shared_out(cores_in_ranks(tmp_path, ranks), max(1, CORES // ranks))


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_ranks_under_torchrun_are_bound_and_an_eager_runs_default_leaves_them_free(tmp_path):
    threads = threads_in_ranks(tmp_path / "torchrun", "1x2", "plan=seed_mlp_tp", "launcher.bind_cores=true",
                               prefix=[TORCHRUN, "--standalone", "--nproc-per-node", "2"])
    assert_shared_out(cores_in_ranks(tmp_path / "torchrun", 2), threads[0])
    threads_in_ranks(tmp_path / "free", "1x2", "plan=seed_mlp_tp")  # eager: null leaves them free
    assert cores_in_ranks(tmp_path / "free", 2) == {0: ALL_CORES, 1: ALL_CORES}


def test_a_rank_s_cores_follow_the_previous_ranks_and_wrap_round():
    sixteen = list(range(16))
    assert [cores_of_rank(sixteen, rank, 5) for rank in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                                                       [10, 11, 12, 13, 14]]
    assert [cores_of_rank([0, 1], rank, 1) for rank in range(4)] == [[0], [1], [0], [1]]
    assert [cores_of_rank([2, 3, 6, 7], rank, 3) for rank in range(2)] == [[2, 3, 6], [2, 3, 7]]
    assert cores_of_rank([0, 1], 1, 4) == [0, 1]  # more threads than cores: all of them
    # null: compiled CPU runs bound, eager ones and GPU ones free
    def binds(bind, device, compiled):
        return binds_cores(compose_config([f"launcher.bind_cores={bind}", f"mesh.device_type={device}",
                                           f"trainer.compile={'blocks' if compiled else 'none'}"]))
    assert binds("null", "cpu", True) and not binds("null", "cpu", False) and not binds("null", "cuda", True)
    assert binds("true", "cuda", False) and not binds("false", "cpu", True)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_an_exported_omp_num_threads_wins_over_the_key_which_wins_over_the_rule(tmp_path):
    assert threads_in_ranks(tmp_path / "key", "1x1", "plan=none", "launcher.threads_per_rank=3") == {0: 3}
    assert threads_in_ranks(tmp_path / "env", "1x1", "plan=none", "launcher.threads_per_rank=3", omp="5") == {0: 5}


def test_torchruns_own_default_of_one_thread_is_not_the_users(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads_per_rank(None, 2, "1") == (max(1, CORES // 2), "this host's cores shared out among its ranks")
    assert threads_per_rank(None, 2, "2") == (2, "OMP_NUM_THREADS exported")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # a SLURM task: an exported 1 is the user's
    assert threads_per_rank(4, 2, "1") == (1, "OMP_NUM_THREADS exported")
