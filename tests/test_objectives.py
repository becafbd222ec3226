"""The objective group (framework.training.objectives): what a step optimizes, as a loss sum and
a count of units per micro-batch, normalized over the global batch. Against torch's own means and
a one-process loop written by hand; the moved `data.loss` key is refused naming its new place."""
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from framework.launch.local import launch_local
from framework.config.errors import ConfigError
from framework.validate import validate
from framework.models.protocol import ModelProtocol
from framework.training.objectives.base import StepShare
from framework.training.objectives.lm import MeanSquaredError, NextTokenCrossEntropy
from tests.conftest import QUIET, TEST_MODELS, TINY_LM, compose_config, run_cli
from tests.errors import max_relative_error
from tests.test_cli import read_events


def test_each_objectives_sum_over_its_count_is_torchs_mean():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    targets[0, :4] = targets[2, 1] = -100  # a prompt and a pad: not units
    lm = NextTokenCrossEntropy()
    assert int(lm.count(targets)) == 10
    torch.testing.assert_close(lm.loss_sum(logits, targets) / lm.count(targets),
                               F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)), rtol=1e-5, atol=1e-6)
    outputs, values = torch.randn(4, 6), torch.randn(4, 6)
    mse = MeanSquaredError()
    assert int(mse.count(values)) == 24
    torch.testing.assert_close(mse.loss_sum(outputs, values) / mse.count(values), F.mse_loss(outputs, values),
                               rtol=1e-5, atol=1e-6)


def test_each_data_group_picks_its_objective_and_the_command_line_wins():
    target = lambda overrides: compose_config(overrides).objective._target_.rsplit(".", 1)[1]  # noqa: E731
    assert target([]) == "MeanSquaredError"  # the seed's regression
    for data in ("byte_corpus", "tokens", "instructions"):
        assert target([f"data={data}"]) == "NextTokenCrossEntropy"
    assert target(["recipe=lm_2d", "objective=mse"]) == "MeanSquaredError"


@pytest.mark.parametrize("override", ["data.loss._target_=torch.nn.MSELoss", "+data.loss._target_=torch.nn.MSELoss"])
def test_a_config_that_still_sets_data_loss_is_refused_naming_the_objective_group(override, tmp_path):
    result = run_cli([override, f"hydra.run.dir={tmp_path}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(": no such key; the loss moved to the objective group: objective=lm "
                                          "(next-token cross entropy) or objective=mse, their options as "
                                          "objective.<key> (conf/objective/)"), result.stderr
    assert result.stderr.startswith("config error: data.loss") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs").exists()


def test_a_recipe_that_still_sets_data_loss_is_told_where_it_moved(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "old.yaml").write_text("# @package _global_\ndata:\n  loss:\n    _target_: torch.nn.MSELoss\n")
    result = run_cli(["--config-dir", str(tmp_path), "recipe=old", f"hydra.run.dir={tmp_path / 'job'}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("config error: data.loss: no such key; the loss moved to the objective group: "
                                     "objective=lm (next-token cross entropy) or objective=mse, their options as "
                                     "objective.<key> (conf/objective/)")


def test_a_term_the_model_reports_without_a_weight_is_refused_by_name():
    class Reports(ModelProtocol, nn.Module):
        auxiliary_losses = {"balance": torch.tensor(1.0)}

    with pytest.raises(KeyError, match=r"Reports reports the auxiliary loss 'balance': give its weight as "
                                       r"objective.aux_coefficients.balance"):
        NextTokenCrossEntropy()(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), Reports(),
                                StepShare(units=2.0, tokens=2.0))


AUX = [*TINY_LM, *QUIET, TEST_MODELS, "model._target_=tests.workers.LogitSquareTransformer", "plan=none",
       "+objective.aux_coefficients.logit_square=0.05", "optim=sgd", "~optim.betas", "optim.lr=0.5",
       "trainer.warmup_steps=0", "trainer.lr_decay=constant", "trainer.grad_clip=null", "trainer.eval_every=null",
       "trainer.max_steps=4", "trainer.log_every=1"]


def by_hand(cfg) -> dict:
    """One process, plain torch: cross entropy's mean plus 0.05 x the mean over the global batch's
    tokens of their mean squared logit; each step's loss and that mean."""
    torch.manual_seed(cfg.trainer.seed)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optim)(model.parameters())
    dataset = instantiate(cfg.data.dataset)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, seed=cfg.sampler.seed)
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True))
    losses, squares = [], []
    for _ in range(4):
        inputs, targets = next(batches)
        logits = model(inputs)
        square = logits.pow(2).mean()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)) + 0.05 * square
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        squares.append(square.item())
    return {"losses": losses, "squares": squares}


@pytest.mark.timeout(240)
def test_an_auxiliary_term_is_weighted_logged_and_the_same_on_every_mesh(tmp_path):
    """As a mixture of experts' load-balancing loss will be: the model reports a sum over its
    tokens, the objective adds it weighted, the step normalizes it with the loss over the global
    batch (2 DP replicas x 2 micro-batches each train what one process does), and TensorBoard
    shows it as loss_logit_square."""
    reference = by_hand(compose_config([*AUX, "mesh=1x1"]))
    for mesh, extra in (("1x1", []), ("2x1", ["data.micro_batch_size=2", "logger.tensorboard=true"])):
        cfg = compose_config([*AUX, f"mesh={mesh}", *extra])
        summary = launch_local(cfg, str(tmp_path / mesh))
        assert max_relative_error(summary["losses"], reference["losses"]) < 1e-5, mesh
    logged = [event.value for event in read_events(tmp_path / "2x1" / "tb").Scalars("loss_logit_square")]
    assert max_relative_error(logged, reference["squares"]) < 1e-5


def test_a_model_reporting_terms_under_pipeline_parallelism_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"objective.aux_coefficients.logit_square=0.05: LogitSquareTransformer reports "
                                          r"this auxiliary loss term, which pipeline parallelism cannot add to the last "
                                          r"stage's loss yet; set it to 0"):
        validate(compose_config([*AUX, "mesh=pp2x1x1", "model.n_layers=4"]))
