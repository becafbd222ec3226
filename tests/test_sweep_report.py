"""The sweep report every -m run ends with (framework/report.py), and a sweep that goes on past a
failed job and then exits 1."""
import csv
import json
import math
import statistics
import uuid
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.report import SweepReport, sweep_rows, write_report
from tests.conftest import TEST_MODELS, processes_with_marker, run_cli

FAST = ["trainer.max_steps=4", "trainer.progress_bar=false"]
FAIL_ON_RANK_1 = [TEST_MODELS, "model._target_=tests.workers.FailOnRank",
                  "+model.fail_rank=1"]


def csv_rows(sweep: Path) -> list:
    with open(sweep / "sweep_report.csv", newline="") as f:
        return list(csv.DictReader(f))


def table(sweep: Path) -> str:
    """The table part of sweep_report.md, which the command also prints."""
    return "\n".join(line for line in (sweep / "sweep_report.md").read_text().splitlines() if line.startswith("|"))


@pytest.mark.timeout(240)
def test_a_sweep_over_mesh_shapes_ends_with_its_report(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "mesh=2x1,1x2", *FAST, f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    rows = csv_rows(sweep)
    assert [(r["job"], r["mesh"], r["plan"], r["status"], r["error"]) for r in rows] == [
        ("0", "2x1", "seed_mlp_tp", "ok", ""), ("1", "1x2", "seed_mlp_tp", "ok", "")]
    assert rows[0]["overrides"].split() == ["mesh=2x1", "trainer.max_steps=4", "trainer.progress_bar=False"]
    for row, summary in zip(rows, summaries):
        assert float(row["final_loss"]) == summary["final_loss"]  # full precision, not rounded for show
        assert float(row["samples_per_s"]) == summary["samples_per_s"]
        assert float(row["median_step_s"]) == statistics.median(summary["step_times_s"][1:])
        assert row["best_val_loss"] == row["tokens_per_s"] == ""
        assert int(row["bytes_per_rank"]) == summary["memory"]["max_over_ranks"]["total"]
    assert "| 0 | mesh=2x1 | 2x1 | seed_mlp_tp |" in table(sweep)  # the common overrides are said once
    assert table(sweep) in result.stdout
    assert (sweep / "sweep_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each mesh shape trained the same model, and each job logged to TensorBoard
    assert summaries[0]["losses"] == pytest.approx(summaries[1]["losses"], rel=1e-5)
    assert all(list((sweep / str(i) / "tb").iterdir()) for i in range(2))


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_failed_job_is_reported_and_the_sweep_goes_on_then_exits_1(tmp_path):
    """Job 0 loses rank 1, job 1 is refused at validation (TP 5 does not divide the seed MLP),
    job 2 (one rank, so no rank 1) runs after both."""
    sweep = tmp_path / "sweep"
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    result = run_cli(["-m", "mesh.shape=[2,1],[1,5],[1,1]", *FAIL_ON_RANK_1, *FAST, f"hydra.sweep.dir={sweep}"],
                     env={marker: "1"})
    assert result.returncode == 1, result.stderr
    rows = csv_rows(sweep)
    assert [(r["mesh"], r["status"]) for r in rows] == [("2x1", "failed"), ("1x5", "failed"), ("1x1", "ok")]
    assert rows[0]["error"].startswith("training failed: rank 1 failed: ")
    assert "boom on rank 1" in rows[0]["error"]
    assert rows[1]["error"].startswith("config error: plan.net1='colwise': ")
    for row in rows[:2]:
        assert row["error"] in result.stderr  # the line a single run would end with
        assert row["final_loss"] == ""
    assert (sweep / "1" / "error.txt").exists()  # a refused job's dir stays in a sweep, for the report
    assert float(rows[2]["final_loss"]) == json.loads((sweep / "2" / "summary.json").read_text())["final_loss"]
    assert "| failed | training failed: rank 1 failed" in table(sweep)
    assert table(sweep) in result.stdout
    assert processes_with_marker(marker) == []


def fake_job(sweep: Path, name: str, num: int, overrides: list, shape: list, summary: dict = None,
             error: str = None) -> None:
    """A job dir as Hydra and framework.train leave it, reduced to what the report reads."""
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    hydra_cfg = {"job": {"num": num}, "overrides": {"task": overrides}, "runtime": {"choices": {"plan": "seed_mlp_tp"}}}
    OmegaConf.save({"hydra": hydra_cfg}, job / ".hydra" / "hydra.yaml")
    OmegaConf.save({"mesh": {"shape": shape}}, job / ".hydra" / "config.yaml")
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job / "error.txt").write_text(error + "\n")


@pytest.mark.timeout(60)
def test_rows_come_from_the_job_dirs(tmp_path):
    lm = {"final_loss": 1.25, "losses": [2.0, 1.5, 1.25], "val_losses": [[1, 1.9], [2, 1.4], [3, 1.6]],
          "step_times_s": [9.0, 0.25, 0.75, 0.5], "samples_per_s": 64.0, "tokens_per_s": 2048.0, "memory": {"max_over_ranks": {"total": 123456}}}
    seed = {"final_loss": 0.5, "losses": [0.5], "val_losses": [], "step_times_s": [9.0], "samples_per_s": math.nan,
            "tokens_per_s": None}
    fake_job(tmp_path, "10", 10, ["model=lm_tiny", "trainer.max_steps=4"], [1, 2], summary=lm)
    fake_job(tmp_path, "2", 2, ["model=seed_mlp", "trainer.max_steps=4"], [2, 1], summary=seed)
    fake_job(tmp_path, "3", 3, ["model=boom", "trainer.max_steps=4"], [2, 2], error="training failed: rank 1 failed")
    (tmp_path / "notes").mkdir()  # not a job: no .hydra/

    rows = sweep_rows(tmp_path)
    assert [row["job"] for row in rows] == [2, 3, 10]  # by job number, not by dir name
    seed_row, failed, lm_row = rows
    assert lm_row["mesh"] == "1x2" and lm_row["plan"] == "seed_mlp_tp"
    assert lm_row["best_val_loss"] == 1.4
    assert lm_row["median_step_s"] == 0.5  # step 1's 9 s left out
    assert lm_row["bytes_per_rank"] == 123456 and lm_row["status"] == "ok"
    assert seed_row["samples_per_s"] is None and seed_row["median_step_s"] is None  # too short to time
    assert seed_row["best_val_loss"] is None and seed_row["tokens_per_s"] is None
    assert failed["status"] == "failed" and failed["error"] == "training failed: rank 1 failed"
    assert failed["final_loss"] is None and failed["mesh"] == "2x2"

    printed = write_report(rows, tmp_path)
    assert "overrides common to every job: trainer.max_steps=4" in printed
    assert "| 10 | model=lm_tiny | 1x2 | seed_mlp_tp | 1.25 | 1.4 | 64.0 | 2048 | 0.5000 | 123,456 | ok |  |" in printed
    assert "| 3 | model=boom | 2x2 | seed_mlp_tp |  |  |  |  |  |  | failed | training failed: rank 1 failed |" in printed
    with open(tmp_path / "sweep_report.csv", newline="") as f:
        assert [(r["job"], r["samples_per_s"], r["overrides"]) for r in csv.DictReader(f)] == [
            ("2", "", "model=seed_mlp trainer.max_steps=4"), ("3", "", "model=boom trainer.max_steps=4"),
            ("10", "64.0", "model=lm_tiny trainer.max_steps=4")]
    assert (tmp_path / "sweep_report.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_the_callback_exits_1_only_when_a_job_failed(tmp_path, capsys):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    fake_job(tmp_path, "0", 0, ["mesh=2x1"], [2, 1], summary={"final_loss": 0.5, "losses": [0.5]})
    SweepReport().on_multirun_end(config=config)  # returns: the command exits 0
    assert "| 0 | mesh=2x1 |" in capsys.readouterr().out
    fake_job(tmp_path, "1", 1, ["mesh=1x2"], [1, 2], error="config error: mesh.shape=[1, 2]: why")
    with pytest.raises(SystemExit) as exit_:
        SweepReport().on_multirun_end(config=config)
    assert exit_.value.code == 1
    assert (tmp_path / "sweep_report.md").read_text().count("| failed | config error: mesh.shape=[1, 2]: why |") == 1


def test_a_job_with_a_long_line_of_overrides_still_gets_a_readable_plot(tmp_path):
    """Its label is shortened in the plot (matplotlib warned that the axes collapsed to zero and
    drew nothing); the table keeps the whole line."""
    long = [f"+model.out={tmp_path / ('x' * 120)}", "allowed_targets=[framework,torch.nn,torch.optim,tests]"]
    fake_job(tmp_path, "0", 0, long, [2, 1], summary={"final_loss": 1.0, "losses": [2.0, 1.0], "val_losses": [],
                                                      "step_times_s": [9.0, 0.5], "samples_per_s": 8.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        printed = write_report(sweep_rows(tmp_path), tmp_path)
    assert " ".join(long) in printed
