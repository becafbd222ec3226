"""Checkpoints on real gloo groups: exact resume, resume on other meshes and plans against one
process, automatic restart after kill -9, a kill during a save, async == sync, bad input,
export."""
import json
import os
import re
import shutil
import uuid
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from framework.checkpoint import manager
from framework.checkpoint.layout import complete_checkpoints, keep_newest, newest_checkpoint, remove_partial, resolve
from framework.config.errors import ConfigError
from framework.validate import validate
from framework.launch.handoff import rank_config
from framework.launch.local import launch_local, spawn_ranks
from framework.models import SeedMLP
from tests.conftest import QUIET, TEST_MODELS, TORCHRUN, compose_config, processes_with_marker, run_cli
from tests.errors import max_relative_error
from tests.reference import reference_training
from tests.workers import output_after_loading

# The seed MLP with AdamW (optimizer state to save and reshard), 20 steps, a checkpoint every 5.
SEED = ["mesh=2x2", "optim=adamw", "optim.lr=0.01", "trainer.max_steps=20", "trainer.log_every=5",
        "checkpoint.every=5", *QUIET]


def _run(overrides, out_dir) -> dict:
    return launch_local(compose_config(overrides), str(out_dir))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2x2 run, keeping its last three checkpoints, saved asynchronously (the
    kill tests save synchronously: test_kill_9... compares the files)."""
    out = tmp_path_factory.mktemp("straight")
    summary = _run([*SEED, "checkpoint.keep_last=3", "checkpoint.async_save=true"], out)
    return {"summary": summary, "dir": out / "checkpoints"}


@pytest.fixture(scope="module")
def one_process(straight):
    """The same training written by hand in one process: the reference for every mesh."""
    return reference_training(compose_config([*SEED, "mesh=1x1"]))


@pytest.mark.timeout(180)
def test_checkpoints_are_complete_and_keep_last_removes_older_ones(straight):
    assert [step for step, _ in complete_checkpoints(straight["dir"])] == [10, 15, 20]
    step_10 = straight["dir"] / "step_10"
    assert sorted(p.name for p in step_10.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "framework.json"]
    meta = json.loads((step_10 / "framework.json").read_text())
    assert meta["step"] == 10 and meta["data"] == {"epoch": 0, "samples": 240, "global_batch_size": 24}
    assert meta["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"]} and meta["world_size"] == 4
    assert meta["history"]["losses"] == straight["summary"]["losses"][:10]
    assert meta["scheduler"]["last_epoch"] == 10
    assert set(meta["versions"]) == {"torch", "framework"}
    saves = straight["summary"]["checkpoints"]
    assert [s["step"] for s in saves] == [5, 10, 15, 20]
    assert all(s["total_s"] >= s["blocking_s"] > 0 for s in saves)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mesh", [pytest.param("1x4", marks=pytest.mark.integration), "2x1", "1x1"])
def test_resume_on_another_mesh_continues_the_one_process_loss_curve(mesh, straight, one_process, tmp_path):
    overrides = [*SEED, f"mesh={mesh}", f"checkpoint.resume={straight['dir']}/step_10"]
    if mesh == "1x1":
        overrides.append("plan=none")
    summary = _run(overrides, tmp_path)
    error = max_relative_error(summary["losses"], one_process["losses"])
    print(f"resume 2x2 seed_mlp_tp -> {mesh}: max relative loss error vs 1x1 {error:.2e}")
    assert error < 1e-5
    assert summary["resumed_from"]["step"] == 10


@pytest.mark.timeout(240)
def test_a_checkpoint_moves_between_dp_strategies_on_the_one_process_loss_curve(straight, one_process, tmp_path):
    # replicate 2x2 (steps 1-10, the straight run) -> fsdp 4x1 (11-15) -> hsdp 2x2x1 (16-20): DCP
    # reshards parameters and AdamW state from full copies to FSDP shards to HSDP shards.
    fsdp = _run([*SEED, "mesh=4x1", "parallel.dp_strategy=fsdp", "trainer.max_steps=15",
                 f"checkpoint.resume={straight['dir']}/step_10"], tmp_path / "fsdp")
    hsdp = _run([*SEED, "mesh=2x2x1", "parallel.dp_strategy=hsdp",
                 f"checkpoint.resume={tmp_path}/fsdp/checkpoints/step_15"], tmp_path / "hsdp")
    error = max_relative_error(hsdp["losses"], one_process["losses"])
    print(f"resume replicate 2x2 -> fsdp 4x1 -> hsdp 2x2x1: max relative loss error vs 1x1 {error:.2e}")
    assert error < 1e-5
    assert fsdp["resumed_from"]["step"] == 10 and hsdp["resumed_from"]["step"] == 15
    assert hsdp["losses"][:15] == fsdp["losses"]  # the history travels with the checkpoint


LM = ["recipe=lm_2d", "model=lm_tiny", "data.dataset.max_bytes=65536", "data.dataset.seq_len=32",
      "data.global_batch_size=8", "trainer.warmup_steps=0", "trainer.lr_decay=constant", "trainer.grad_clip=null",
      "trainer.eval_every=null", "optim.lr=0.003", "trainer.max_steps=10", "trainer.log_every=5",
      "checkpoint.every=5", *QUIET]


@pytest.mark.timeout(240)
def test_lm_saved_under_tp_sp_resumes_under_another_plan_and_tp_size(tmp_path):
    saved = _run([*LM, "mesh=1x2", "plan=lm_tp_sp"], tmp_path / "saved")
    reference = reference_training(compose_config([*LM, "mesh=1x1", "plan=none"]))  # one process, by hand
    for mesh, plan in [("2x1", "lm_tp")]:  # another plan and TP size (tested to 1x1 for the seed MLP)
        summary = _run([*LM, f"mesh={mesh}", f"plan={plan}", f"checkpoint.resume={tmp_path}/saved/checkpoints/step_5"],
                       tmp_path / f"{mesh}-{plan}")
        error = max_relative_error(summary["losses"], reference["losses"])
        print(f"resume 1x2 lm_tp_sp -> {mesh} {plan}: max relative loss error vs 1x1 {error:.2e}")
        assert error < 1e-4
    assert max_relative_error(saved["losses"], reference["losses"]) < 1e-4


@pytest.mark.timeout(300)
def test_kill_9_of_a_rank_restarts_every_rank_from_the_newest_checkpoint(straight, tmp_path):
    """Rank 1 dies by SIGKILL in step 13, after checkpoint 10 and logged step 12; the agent
    restarts all ranks, they resume from step 10 and the job ends as if nothing happened."""
    out = tmp_path / "job"
    result = run_cli([*SEED, "logger.tensorboard=true", "trainer.log_every=2", "launcher.max_restarts=1", TEST_MODELS,
                      "model._target_=tests.workers.KillAtForward", "+model.rank=1", "+model.at=13",
                      f"hydra.run.dir={out}"], timeout=240)
    assert result.returncode == 0, result.stderr
    # One console line per event, each rank's traceback in its log only.
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip() == "rank 1 was killed by signal SIGKILL; restarting every rank (1 of 1)"
    restarted = f"restart 1 of 1: resumed from {out / 'checkpoints' / 'step_10'} (step 10)"
    assert restarted in result.stdout and restarted in (out / "logs" / "rank0.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == straight["summary"]["losses"]  # same mesh: bitwise, all 20 steps
    assert summary["grad_norms"][4::5] == straight["summary"]["grad_norms"][1::2]  # steps 10 and 20
    assert summary["restarts"] == 1
    assert summary["resumed_from"]["path"] == str(out / "checkpoints" / "step_10")
    assert summary["resumed_from"]["step"] == 10 and summary["resumed_from"]["load_s"] > 0
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(2, 21, 2))  # steps 12 logged twice, shown once
    # Its sync saves hold what the straight run's async saves hold, tensor for tensor.
    for step in (15, 20):
        contents = []
        for directory in (out / "checkpoints", straight["dir"]):
            dcp_to_torch_save(directory / f"step_{step}", tmp_path / "all.pt")
            contents.append(_flat(torch.load(tmp_path / "all.pt", weights_only=False)))
        assert contents[0].keys() == contents[1].keys()
        assert any(key.startswith("optim.state.net1.weight.exp_avg") for key in contents[0])
        for key, value in contents[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, contents[1][key]), key
            else:
                assert value == contents[1][key], key


def _flat(state: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.timeout(300)
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_which_auto_resumes(one_process, tmp_path):
    out = tmp_path / "job"
    result = run_cli([*SEED, "mesh=2x1", "launcher.max_restarts=1", TEST_MODELS, "model._target_=tests.workers.KillInSave",
                      "+model.rank=0", "+model.at=2", f"hydra.run.dir={out}"], timeout=240)
    assert result.returncode == 0, result.stderr
    log = (out / "logs" / "rank0.log").read_text()
    assert f"removed {out / 'checkpoints' / '.partial_step_10'}, left by an interrupted save" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 5
    assert max_relative_error(summary["losses"], one_process["losses"]) < 1e-5
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [5, 10, 15, 20]




@pytest.mark.integration
@pytest.mark.timeout(300)
def test_under_torchrun_max_restarts_resumes_in_the_first_attempts_job_dir(one_process, tmp_path):
    """torchrun's own --max-restarts restarts the world; rank 0's Hydra makes a new timestamped
    dir, yet the run continues in the first one, where its checkpoints are."""
    result = run_cli([*SEED, "mesh=2x1", TEST_MODELS, "model._target_=tests.workers.KillAtForward", "+model.rank=1",
                      "+model.at=13", f"hydra.run.dir={tmp_path}/" + "${now:%H-%M-%S-%f}"], timeout=240,
                     prefix=[TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    job, = tmp_path.iterdir()  # the restart's own dir was removed
    summary = json.loads((job / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from"]["path"] == str(job / "checkpoints" / "step_10")
    assert max_relative_error(summary["losses"], one_process["losses"]) < 1e-5


@pytest.mark.timeout(120)
def test_export_and_init_from_give_the_model_the_sharded_one_computes(straight, tmp_path):
    result = run_cli([str(straight["dir"]), str(tmp_path / "model.pt")], module="framework.export")
    assert result.returncode == 0, result.stderr
    model = SeedMLP()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))  # plain keys, no distributed set-up
    inputs = torch.randn(5, 12, generator=torch.Generator().manual_seed(7))
    # The same weights as init_from of a TP-sharded 1x2 run (fine-tuning's start). The sharded
    # model sums a rowwise layer's partial products in another order (all-reduced halves), so
    # the outputs agree to float32 rounding, not bitwise: the suite's tolerance for that.
    cfg = compose_config([*SEED, "mesh=1x2", "checkpoint.resume=null", f"checkpoint.init_from={straight['dir']}"])
    sharded = spawn_ranks(2, output_after_loading, rank_config(cfg), str(tmp_path / "ranks"), inputs)[0]
    torch.testing.assert_close(model(inputs).detach(), sharded, rtol=1e-5, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------------

def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy


@pytest.mark.parametrize("make,overrides,message", [
    (lambda ck, tmp: tmp / "missing", [], r"checkpoint.resume='.*missing': checkpoint .*missing: no such directory"),
    (lambda ck, tmp: tmp, [], r"checkpoint .*: holds no complete checkpoint"),
    (lambda ck, tmp: ck.parent / ".partial_step_10", [], r"no framework.json: not a complete checkpoint"),
    (lambda ck, tmp: ck, ["data.global_batch_size=48"],
     r"data.global_batch_size=48: checkpoint .*step_10 was saved with 24, and a change reorders the global batches"),
    (lambda ck, tmp: ck, ["sampler.seed=1"], r"sampler.seed=1: checkpoint .* was saved with 0"),
    (lambda ck, tmp: ck, ["model.hidden_dim=32"],
     r"model key 'net1.weight' has shape \[48, 12\] there but \[32, 12\] in this model"),
    (lambda ck, tmp: ck, ["model=lm_tiny", "data=byte_corpus", "plan=none", "optim=sgd", "data.dataset.max_bytes=65536"],
     r"has no model key 'tok_embeddings.weight' \(shape \[256, 32\] in this model\): another model's checkpoint"),
    (lambda ck, tmp: ck, ["checkpoint.init_from=/x"], r"checkpoint.init_from='/x': a run either resumes"),
    (lambda ck, tmp: ck, ["checkpoint.every=0"], r"checkpoint.every=0: must be >= 1"),
], ids=["missing", "empty-dir", "partial", "batch-size", "sampler-seed", "shape", "other-model", "both", "every"])
def test_bad_checkpoint_input_is_refused_before_launch(make, overrides, message, straight, tmp_path):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    shutil.copytree(checkpoint, checkpoint.parent / ".partial_step_10")
    (checkpoint.parent / ".partial_step_10" / "framework.json").unlink()
    cfg = compose_config([*SEED, *overrides, f"checkpoint.resume={make(checkpoint, tmp_path)}"])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, out_dir=str(tmp_path / "job"))


def test_reset_data_accepts_a_new_batch_order(straight, tmp_path):
    cfg = compose_config([*SEED, "data.global_batch_size=48", "checkpoint.reset_data=true",
                          f"checkpoint.resume={straight['dir']}/step_10"])
    validate(cfg, out_dir=str(tmp_path))


def test_unreadable_metadata_is_refused(straight, tmp_path):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    (checkpoint / ".metadata").write_bytes(b"not a pickle")
    cfg = compose_config([*SEED, f"checkpoint.resume={checkpoint}"])
    with pytest.raises(ConfigError, match=r"checkpoint .*step_10: unreadable .metadata \(UnpicklingError"):
        validate(cfg, out_dir=str(tmp_path))


@pytest.mark.timeout(120)
def test_the_cli_exits_2_on_a_bad_resume_path_and_leaves_no_job_dir(tmp_path):
    out = tmp_path / "job"
    result = run_cli([*SEED, f"checkpoint.resume={tmp_path / 'nowhere'}", f"hydra.run.dir={out}"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"config error: checkpoint.resume='{tmp_path / 'nowhere'}': checkpoint {tmp_path / 'nowhere'}: no such "
        f"directory; give a step_N checkpoint or a checkpoints dir")
    assert not out.exists()


@pytest.mark.timeout(180)
def test_a_truncated_shard_fails_the_run_with_one_line_and_no_rank_left(straight, tmp_path):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    shard = checkpoint / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    marker = f"FRAMEWORK_TEST_{uuid.uuid4().hex}"
    result = run_cli([*SEED, "mesh=2x1", f"checkpoint.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'job'}"],
                     env={marker: "1"})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(rf"training failed: rank \d failed: .*CheckpointError: checkpoint {checkpoint}: cannot be loaded: "
                    rf"\w+Error", last), last
    assert processes_with_marker(marker) == []


@pytest.mark.timeout(60)
def test_a_missing_shard_is_named(straight, tmp_path):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    (checkpoint / "__1_0.distcp").unlink()
    result = run_cli([str(checkpoint), str(tmp_path / "out.pt")], module="framework.export")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"export failed: checkpoint {checkpoint}: cannot be loaded: FileNotFoundError: [Errno 2] No such file or "
        f"directory: '{checkpoint / '__1_0.distcp'}' (on rank 0)")


@pytest.mark.timeout(60)
def test_export_refuses_a_path_without_a_checkpoint(tmp_path):
    result = run_cli([str(tmp_path), str(tmp_path / "out.pt")], module="framework.export")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"export failed: checkpoint {tmp_path}: holds no complete checkpoint (no step_N dir with framework.json)")
    assert not (tmp_path / "out.pt").exists()


# -- the directory layout, without processes ------------------------------------------------------

def _fake_checkpoint(directory: Path, name: str, complete: bool = True) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    if complete:
        (path / "framework.json").write_text("{}")
    return path


def test_auto_picks_the_checkpoint_completed_last_not_the_highest_step(tmp_path):
    # A run with checkpoint.resume=null in a dir that held step_25 saved step_5 after it.
    old, new = _fake_checkpoint(tmp_path, "step_25"), _fake_checkpoint(tmp_path, "step_5")
    os.utime(old / "framework.json", (1_000_000, 1_000_000))
    assert resolve("auto", str(tmp_path)) == str(new)
    assert keep_newest(str(tmp_path), 1) == [str(old)]


def test_auto_picks_the_newest_complete_checkpoint_and_partial_ones_are_removed(tmp_path):
    for step in (5, 10, 100):
        _fake_checkpoint(tmp_path, f"step_{step}")
    _fake_checkpoint(tmp_path, "step_200", complete=False)  # no framework.json: not visible
    _fake_checkpoint(tmp_path, ".partial_step_300")
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "step_100")  # numeric order, not text
    assert resolve("auto", str(tmp_path)) == str(tmp_path / "step_100")
    assert resolve(str(tmp_path), "unused") == str(tmp_path / "step_100")
    assert resolve("auto", str(tmp_path / "none")) is None
    assert remove_partial(str(tmp_path)) == [str(tmp_path / ".partial_step_300")]
    assert keep_newest(str(tmp_path), 2) == [str(tmp_path / "step_5")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_100", "step_200"]


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_checkpoint_at_or_past_max_steps_leaves_nothing_to_train(tmp_path):
    job = ["mesh=2x1", "trainer.log_every=2", "checkpoint.every=2", *QUIET, f"hydra.run.dir={tmp_path}"]
    first = run_cli([*job, "trainer.max_steps=4"])
    assert first.returncode == 0, first.stderr
    summary = (tmp_path / "summary.json").read_text()
    for steps in (4, 2):  # at max_steps, past it: no rank starts, summary.json stays as it was
        again = run_cli([*job, f"trainer.max_steps={steps}"])
        assert again.returncode == 0, again.stderr
        assert f"nothing to train: {tmp_path / 'checkpoints' / 'step_4'} is at step 4 and trainer.max_steps={steps}; " \
               f"raise trainer.max_steps to train on" in again.stdout
        assert "[rank0]" not in again.stdout and (tmp_path / "summary.json").read_text() == summary
    # One step after the resumed checkpoint: a first step only, which is not timed: null, not NaN.
    one = run_cli([*job, "trainer.max_steps=5"])
    assert one.returncode == 0, one.stderr
    assert "samples/s not measured (only a first step)" in one.stdout
    resumed = json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail)
    assert resumed["resumed_from"]["step"] == 4 and len(resumed["losses"]) == 5
    assert resumed["samples_per_s"] is None


def test_the_optimizer_saved_before_it_was_flattened_still_loads(tmp_path):
    """Checkpoints of earlier versions hold one param_groups list; they are told apart and load
    into a fresh optimizer with the same state (exact: the same tensors read back)."""
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.manager import OptimizerState, optimizer_saved_flat

    def trained():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = trained()
    for flat in (False, True):
        dcp.save({"optim": OptimizerState(model, optimizer, flat=flat)}, checkpoint_id=str(tmp_path / str(flat)))
        assert optimizer_saved_flat(str(tmp_path / str(flat))) is flat
    fresh_model, fresh = trained()
    fresh.state.clear()
    dcp.load({"optim": OptimizerState(fresh_model, fresh, flat=False)}, checkpoint_id=str(tmp_path / "False"))
    for mine, theirs in zip(fresh.state.values(), optimizer.state.values()):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_the_version_a_checkpoint_records_never_fails_the_save(monkeypatch, tmp_path):
    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(manager, "version", not_installed)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "framework"\nversion = "9.8.7"\n')
    assert manager.framework_version(str(pyproject)) == "9.8.7 (source tree, not installed)"
    pyproject.write_text("[project\n")
    assert manager.framework_version(str(pyproject)) == "unknown (not installed)"
    assert manager.framework_version(str(tmp_path / "nowhere.toml")) == "unknown (not installed)"


def test_a_checkpoint_dir_that_cannot_be_made_is_refused_before_launch(tmp_path):
    (tmp_path / "a_file").write_text("")
    where = tmp_path / "a_file" / "checkpoints"
    cfg = compose_config([*SEED, f"checkpoint.dir={where}"])
    with pytest.raises(ConfigError, match=rf"checkpoint.dir='{where}': checkpoints go to {where}, but "
                                          rf"{tmp_path / 'a_file'} is not a writable directory; point checkpoint.dir"):
        validate(cfg, out_dir=str(tmp_path / "job"))
    validate(compose_config([*SEED, f"checkpoint.dir={tmp_path / 'new' / 'checkpoints'}"]), out_dir=str(tmp_path / "job"))
