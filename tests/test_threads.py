"""Threads per rank: this host's cores shared out among its ranks unless the user says otherwise,
read back from torch inside the ranks (whatever machine runs the suite)."""
import os

import pytest

from framework.launch.threads import threads_per_rank
from tests.conftest import TEST_MODELS, run_cli

CORES = len(os.sched_getaffinity(0))
REPORT = [TEST_MODELS, "model._target_=tests.workers.ReportThreads",
          "trainer.max_steps=1", "trainer.progress_bar=false", "logger.tensorboard=false"]


def threads_in_ranks(tmp_path, mesh: str, *overrides: str, omp: str | None = None) -> dict:
    result = run_cli([*REPORT, f"+model.out={tmp_path}", f"mesh={mesh}", *overrides,
                      f"hydra.run.dir={tmp_path / 'job'}"], env={"OMP_NUM_THREADS": omp}, timeout=120)
    assert result.returncode == 0, result.stderr
    ranks = 1
    for size in mesh.split("x"):
        ranks *= int(size)
    threads = {rank: int((tmp_path / f"threads.rank{rank}").read_text()) for rank in range(ranks)}
    assert f"{ranks} rank{'s' if ranks > 1 else ''} on {CORES} cores: {threads[0]} thread" in result.stdout
    return threads


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mesh,plan", [("1x1", "plan=none"), ("2x2", "plan=seed_mlp_tp")])
def test_each_rank_gets_its_share_of_the_cores(mesh, plan, tmp_path):
    threads = threads_in_ranks(tmp_path, mesh, plan)
    ranks = len(threads)
    assert set(threads.values()) == {max(1, CORES // ranks)}


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
