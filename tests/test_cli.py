"""End to end through the command line, in subprocesses: outputs, TensorBoard, multirun,
recipes, rank failure, torchrun."""
import json
import math
import uuid
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import TEST_MODELS, TORCHRUN, processes_with_marker, run_cli

FAST = ["trainer.progress_bar=false"]


def read_events(tb_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.mark.timeout(240)
def test_train_writes_one_job_dir_with_summary_logs_and_tensorboard(tmp_path):
    out = tmp_path / "job"
    result = run_cli(["mesh=2x1", "trainer.max_steps=6", "trainer.log_every=2", f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr
    assert "DeviceMesh [dp=2, tp=1]" in result.stdout  # rank 0's layout table
    assert sorted(p.name for p in out.iterdir()) == [".hydra", "logs", "summary.json", "tb", "train.log"]
    assert (out / ".hydra" / "resolved_config.yaml").exists()
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 6 and len(summary["grad_norms"]) == 3
    assert summary["overrides"] == ["mesh=2x1", "trainer.max_steps=6", "trainer.log_every=2"]

    events = read_events(out / "tb")
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([summary["losses"][i] for i in (1, 3, 5)], rel=1e-6)
    assert [e.value for e in events.Scalars("grad_norm")] == pytest.approx(summary["grad_norms"], rel=1e-6)
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.05] * 3)
    assert all(e.value > 0 for e in events.Scalars("samples_per_s"))
    assert all(e.value > 0 for e in events.Scalars("step_time_s"))
    assert events.Scalars("final/loss")[0].value == pytest.approx(summary["final_loss"])
    tags = events.Tags()["tensors"]
    assert "config/text_summary" in tags and "mesh_layout/text_summary" in tags
    layout = events.Tensors("mesh_layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "dp group" in layout and "[0, 1]" in layout
    hparams = events.summary_metadata  # the HPARAMS plugin's session record
    assert any(meta.plugin_data.plugin_name == "hparams" for meta in hparams.values())


@pytest.mark.timeout(240)
def test_seed_mesh_recipe_prints_the_seed_layout_and_stops(tmp_path):
    out = tmp_path / "job"
    result = run_cli(["recipe=seed_mesh", f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr
    assert "DeviceMesh [dp=3, tp=2] ranks [[0, 1], [2, 3], [4, 5]]" in result.stdout
    rows = [line.split(None, 3) for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [r[3] for r in rows] == ["[0, 2, 4]  [0, 1]", "[1, 3, 5]  [0, 1]", "[0, 2, 4]  [2, 3]",
                                    "[1, 3, 5]  [2, 3]", "[0, 2, 4]  [4, 5]", "[1, 3, 5]  [4, 5]"]
    assert not (out / "summary.json").exists()  # it stopped after the mesh stage


@pytest.mark.timeout(240)
def test_a_failing_rank_ends_every_process_and_is_named(tmp_path):
    # With a restart: the failure of each attempt is one line, the tracebacks are in the logs.
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    result = run_cli([TEST_MODELS, "model._target_=tests.workers.FailOnRank",
                      "+model.fail_rank=1", "launcher.max_restarts=1", "checkpoint.every=5", *FAST,
                      f"hydra.run.dir={tmp_path / 'job'}"], env={marker: "1"})
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    first, last = result.stderr.strip().splitlines()
    assert first == ("rank 1 failed: RuntimeError('boom on rank 1') (traceback in logs/rank1.log); restarting every "
                     "rank (1 of 1)")
    assert last.startswith("training failed: rank 1 failed: ")
    assert "boom on rank 1" in last
    assert "logs/rank1.log" in last
    assert "boom on rank 1" in (tmp_path / "job" / "logs" / "rank1.log").read_text()
    assert processes_with_marker(marker) == []  # no rank left running
    assert not (tmp_path / "job" / "summary.json").exists()




@pytest.mark.timeout(240)
def test_torchrun_joins_its_world_and_rank0_owns_the_output_dir(tmp_path):
    out = tmp_path / "job"
    result = run_cli(["mesh=1x2", "trainer.max_steps=4", *FAST, f"hydra.run.dir={out}"],
                     prefix=[TORCHRUN, "--standalone", "--nproc-per-node", "2"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh_shape"] == [1, 2] and len(summary["losses"]) == 4
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert [p.name for p in tmp_path.iterdir()] == ["job"]  # no rank made a dir of its own


@pytest.mark.timeout(240)
def test_torchrun_world_size_must_match_the_mesh(tmp_path):
    result = run_cli(["mesh=2x2", *FAST, f"hydra.run.dir={tmp_path / 'job'}"],
                     prefix=[TORCHRUN, "--standalone", "--nproc-per-node", "2"])
    assert result.returncode != 0
    assert "config error: mesh.shape=[2, 2]: its 4 positions differ from the launched world size 2" in result.stderr
    assert not (tmp_path / "job").exists()


@pytest.mark.timeout(240)
def test_lm_run_logs_tokens_per_second_and_validation_loss(tmp_path):
    out = tmp_path / "job"
    result = run_cli(["recipe=lm_2d", "model=lm_tiny", "mesh=1x2", "data.dataset.max_bytes=65536",
                      "data.dataset.seq_len=32", "data.global_batch_size=4", "trainer.max_steps=6",
                      "trainer.log_every=3", "trainer.eval_every=3", "trainer.eval_batches=2", "trainer.warmup_steps=2",
                      *FAST, f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [step for step, _ in summary["val_losses"]] == [3, 6]
    events = read_events(out / "tb")
    assert [e.value for e in events.Scalars("val_loss")] == pytest.approx([v for _, v in summary["val_losses"]])
    tokens = events.Scalars("tokens_per_s")
    samples = events.Scalars("samples_per_s")
    assert [t.value for t in tokens] == pytest.approx([s.value * 32 for s in samples])
    # 2 warmup steps, then cosine over steps 3..6 down to 10% of optim.lr=0.003 on step 6;
    # each logged lr is the one its step used.
    assert [e.value for e in events.Scalars("lr")] == pytest.approx(
        [0.003 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))), 0.0003])
    assert "mfu" not in events.Tags()["scalars"]  # CPU: no peak FLOPs to compare against


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_bench_runs_every_dp_variant_and_they_train_the_same_model():
    """A short `make bench` (its DP sync part): the driver exits non-zero if DataParallel overlapped,
    DataParallel after backward, torch's DDP and torch's replicate_with_fsdp reach different final
    losses on 2x1 (same model, data, optimizer)."""
    result = run_cli(["--only-dp-sync", "--dp-sync-meshes", "2x1", "--steps", "3", "--repeats", "1"],
                     module="bench.run", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    for side in ("framework, overlapped", "framework, after backward", "torch DDP", "torch replicate_with_fsdp"):
        assert f"| {side} |" in result.stdout
