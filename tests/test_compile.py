"""trainer.compile=blocks: per-block torch.compile trains what eager trains (1x1; TP + SP on
1x2), its checkpoints keep the model's own names and resume eager, and a model without blocks
is refused before launch."""
import json

import pytest
import torch

from tests.conftest import TINY_LM, run_cli

pytestmark = pytest.mark.timeout(400)
STEPS = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=null", "logger.tensorboard=false"]


def losses(out) -> list:
    return json.loads((out / "summary.json").read_text())["losses"]


@pytest.mark.parametrize("mesh,plan", [("1x1", "none"), ("1x2", "lm_tp_sp")])
def test_compiled_blocks_train_the_eager_model_and_their_checkpoint_resumes_eager(tmp_path, mesh, plan):
    base = [*TINY_LM, *STEPS, f"mesh={mesh}", f"plan={plan}"]
    eager = run_cli([*base, f"hydra.run.dir={tmp_path / 'eager'}"])
    compiled = run_cli([*base, "trainer.compile=blocks", "checkpoint.every=2", f"hydra.run.dir={tmp_path / 'compiled'}"])
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")), torch.tensor(losses(tmp_path / "eager")),
                               rtol=1e-5, atol=1e-6)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["first_step_s"] > max(summary["step_times_s"][1:])  # the first step compiled
    if mesh == "1x2":  # saved compiled, resumed eager: the same names, the same curve
        resumed = run_cli([*base, f"hydra.run.dir={tmp_path / 'resumed'}",
                           f"checkpoint.resume={tmp_path / 'compiled' / 'checkpoints' / 'step_2'}"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        torch.testing.assert_close(torch.tensor(losses(tmp_path / "resumed")), torch.tensor(losses(tmp_path / "eager")),
                                   rtol=1e-5, atol=1e-6)


def test_compiling_a_model_without_blocks_is_refused_before_launch(tmp_path):
    result = run_cli(["trainer.compile=blocks", "trainer.progress_bar=false", f"hydra.run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("config error: trainer.compile='blocks': SeedMLP has no `layers` ModuleList of "
                                     "repeated blocks to compile; use trainer.compile=none")
