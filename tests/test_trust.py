"""Recipes, group files and checkpoints from others run no code: every route to instantiation
or unpickling is refused in one line, and the marker file a payload would write never appears."""
import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from framework import export
from framework.checkpoint.layout import CheckpointError
from framework.checkpoint.safe_load import load_checkpoint
from framework.cli import check_before_hydra
from framework.config.errors import ConfigError
from framework.validate import validate
from tests.conftest import TEST_MODELS, compose_config, run_cli
from tests.test_checkpoint import SEED, _copy, straight  # noqa: F401 (the fixture)


class Payload:
    """Unpickling it writes a marker file: what a crafted pickle would do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def recipe_dir(tmp_path, body: str):
    """A config dir with recipe/evil.yaml, as someone else's recipe (--config-dir)."""
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "evil.yaml").write_text("# @package _global_\n" + body)
    return tmp_path / "conf"


ROUTES = {
    "hydra-callback": ("hydra:\n  callbacks:\n    x:\n      _target_: builtins.open\n      _args_: [MARKER, w]\n",
                       "config error: hydra.callbacks.x._target_='builtins.open': Hydra would instantiate it before "
                       "any check"),
    "widened-allowlist": ("allowed_targets: [framework, torch.nn, torch.optim, builtins]\n"
                          "objective:\n  _target_: builtins.open\n  _args_: [MARKER, w]\n",
                          "config error: allowed_targets=['framework', 'torch.nn', 'torch.optim', 'builtins']: set in "),
    "logging-factory": ("hydra:\n  job_logging:\n    handlers:\n      x:\n        (): builtins.open\n"
                        "        file: MARKER\n        mode: w\n",
                        "config error: hydra.job_logging.handlers.x.()='builtins.open': logging would call it"),
    "logging-class": ("hydra:\n  job_logging:\n    handlers:\n      console:\n        class: builtins.open\n",
                      "config error: hydra.job_logging.handlers.console.class='builtins.open': logging would call it"),
    "env-set": ("hydra:\n  job:\n    env_set:\n      LD_PRELOAD: MARKER\n",
                "config error: hydra.job.env_set.LD_PRELOAD="),
    # a target under the allowlist that instantiates a config made from a string at resolution time
    "interpolated-target": ("model:\n  _target_: framework.config.checked.instantiate_checked\n"
                            "  node: \"${oc.create:{_target_: io.open, file: MARKER, mode: w}}\"\n",
                            "config error: model.node._target_='io.open': only targets under"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("mode", [[], ["-m"]], ids=["run", "multirun"])
def test_a_recipe_cannot_make_anything_run(route, mode, tmp_path):
    body, line = ROUTES[route]
    marker = tmp_path / "marker"
    conf = recipe_dir(tmp_path, body.replace("MARKER", str(marker)))
    result = run_cli([*mode, "--config-dir", str(conf), "recipe=evil", "trainer.max_steps=2",
                      f"hydra.run.dir={tmp_path / 'job'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=100)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "job").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.timeout(60)
def test_the_allowlist_widens_only_from_the_command_line_or_the_environment(tmp_path, monkeypatch):
    for overrides in ([TEST_MODELS], []):
        if not overrides:
            monkeypatch.setenv("FRAMEWORK_ALLOWED_TARGETS", "tests")
        validate(compose_config([*overrides, "model._target_=tests.workers.FailOnRank"]))
    monkeypatch.delenv("FRAMEWORK_ALLOWED_TARGETS")
    with pytest.raises(ConfigError, match=r"model._target_='tests.workers.FailOnRank': only targets under"):
        validate(compose_config(["model._target_=tests.workers.FailOnRank"]))


@pytest.mark.timeout(60)
def test_a_hydra_callback_on_the_command_line_is_refused_too(tmp_path):
    marker = tmp_path / "marker"
    result = run_cli(["+hydra.callbacks.x._target_=builtins.open", f"+hydra.callbacks.x._args_=[{marker},w]",
                      f"hydra.run.dir={tmp_path / 'job'}"], timeout=50)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("config error: hydra.callbacks.x._target_='builtins.open'")
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_a_crafted_metadata_pickle_is_refused_naming_the_file_and_runs_nothing(straight, tmp_path, capsys):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    marker = tmp_path / "marker"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    refused = rf"checkpoint {checkpoint}: unreadable .metadata \(RefusedPickle: it names io.open, which is not " \
              rf"checkpoint metadata"
    for key in ("resume", "init_from"):
        cfg = compose_config([*SEED, f"checkpoint.{key}={checkpoint}"] + (["checkpoint.resume=null"] if key == "init_from" else []))
        with pytest.raises(ConfigError, match=refused):
            validate(cfg, out_dir=str(tmp_path / "job"))
    assert export.main([str(checkpoint), str(tmp_path / "out.pt")]) == 2
    assert "RefusedPickle: it names io.open" in capsys.readouterr().err
    assert not marker.exists()


def test_a_pickled_payload_in_a_non_tensor_item_is_refused_and_runs_nothing(tmp_path):
    # (the optimizer's options are such items: the resume tests load them through the same planner)
    marker = tmp_path / "marker"
    dcp.save({"w": torch.ones(2), "options": Payload(str(marker))}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert not marker.exists()  # saving pickles it; only loading would run it
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path / 'ck'}: cannot be loaded: .*Unpickl"):
        load_checkpoint({"w": torch.zeros(2), "options": 0}, str(tmp_path / "ck"), no_dist=True)
    assert not marker.exists()
    shutil.rmtree(tmp_path / "ck")
    dcp.save({"w": torch.ones(2), "options": (0.9, 0.95)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    state = {"w": torch.zeros(2), "options": 0}
    load_checkpoint(state, str(tmp_path / "ck"), no_dist=True)  # plain values load
    assert state["options"] == (0.9, 0.95) and state["w"].sum() == 2


@pytest.mark.timeout(120)
def test_export_checks_a_checkpoints_model_against_your_allowlist_not_the_one_it_carries(straight, tmp_path, capsys):
    checkpoint = _copy(straight["dir"] / "step_10", tmp_path)
    marker = tmp_path / "marker"
    meta = json.loads((checkpoint / "framework.json").read_text())
    meta["config"]["allowed_targets"] = ["framework", "torch.nn", "torch.optim", "io"]
    meta["config"]["model"] = {"_target_": "io.open", "file": str(marker), "mode": "w"}
    (checkpoint / "framework.json").write_text(json.dumps(meta))
    assert export.main([str(checkpoint), str(tmp_path / "out.pt")]) == 2
    assert "model._target_='io.open': only targets under ['framework', 'torch.nn', 'torch.optim']" in \
        capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_a_recipes_slurm_setup_lines_are_refused_and_the_command_line_may_set_them(tmp_path):
    conf = recipe_dir(tmp_path, "hydra:\n  launcher:\n    setup: [touch MARKER]\n")
    overrides = ["--config-dir", str(conf), "recipe=evil", "hydra/launcher=submitit_slurm"]
    with pytest.raises(ConfigError, match=r"hydra.launcher.setup\[0\]='touch MARKER': a config file may not set shell "
                                          r"lines of the SLURM job script"):
        check_before_hydra(["-m", *overrides])
    check_before_hydra(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.setup=[module load x]"])
