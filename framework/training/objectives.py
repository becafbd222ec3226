"""What a step optimizes: the `objective` config group (conf/objective/).

An objective scores one micro-batch as the SUM of its per-unit losses (a unit: a target token
that counts, an output element; later a preference pair) and says how many units a batch's
targets hold. The step's loss is the global sum over the global count, however the units fall
on DP replicas, micro-batches and pipeline stages (StepShare below):
that is what makes every mesh train the model one process trains, masked data included.

A model may report auxiliary terms for a micro-batch (a mixture of experts' load-balancing loss):
its forward sets `auxiliary_losses = {name: sum over the micro-batch's tokens}`
(framework.models.protocol). The objective adds each times its weight (`objective.aux_coefficients`,
else the model's own `aux_coefficients`, e.g. an HF config's router_aux_loss_coef), normalized by the global batch's
tokens the same way (a token count needs no communication), and keeps their values for logging.
"""
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.data.tokens import IGNORE
from framework.models.protocol import offered


@dataclass
class StepShare:
    """What a step's micro-batch losses are normalized by, and the terms they add up: each loss
    sum is divided by `units` (the step's count of units per DP replica; 1: plain sums), each
    auxiliary term by `tokens` (the step's tokens per replica; None: no terms, as in
    evaluation); `terms` sums the step's normalized terms (and DPO's metrics) for logging; `loss`
    is the replica's share of the step's loss so far (torchft's replica groups average it with
    the gradients, framework.parallel.fault_tolerance)."""
    units: float = 1.0
    tokens: Optional[float] = 1.0
    terms: Dict[str, torch.Tensor] = field(default_factory=dict)
    loss: Optional[torch.Tensor] = None

    def add(self, name: str, value: torch.Tensor) -> None:
        self.terms[name] = self.terms.get(name, 0.0) + value


class Objective:
    """Base: `loss_sum(outputs, targets)` and `count(targets)` per objective; the auxiliary terms
    and their coefficients are common to all. An objective that needs more than the model's
    output (DPO's reference model) overrides `setup` (once the run is built) and `forward`."""

    def __init__(self, aux_coefficients: Optional[Mapping[str, float]] = None):
        self.aux_coefficients = dict(aux_coefficients or {})

    def setup(self, run) -> None:
        """What the objective needs of the built run, its weights loaded (the checkpoint stage's end)."""

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        """The outputs loss_sum scores: the model's, on the batch's inputs."""
        return model(batch.inputs, **batch.model_inputs())

    def held_bytes(self) -> Dict[str, int]:
        """Bytes of state the objective holds besides the model's (summary.json memory)."""
        return {}

    def logged_terms(self, model: nn.Module) -> Dict[str, str]:
        """The terms a logging step shows, by their TensorBoard names: each weighed auxiliary term
        (objective.aux_coefficients, or the model's own) as loss_<name>."""
        names = {*self.aux_coefficients, *offered(model).aux_coefficients}
        return {name: f"loss_{name}" for name in sorted(names)}

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """How many units these targets hold (a 0-dim tensor)."""
        raise NotImplementedError

    def count_is_fixed(self, dataset) -> bool:
        """Whether every unit of `dataset`'s batches counts, so a batch's count follows from its
        shape (fixed_count) and the global count needs no communication."""
        return True

    def fixed_count(self, targets: torch.Tensor) -> int:
        """The count when every unit counts, from the shape alone (no device sync): one unit per
        target element (a token, an output value)."""
        return targets.numel()

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, model: nn.Module,
                 step: StepShare) -> torch.Tensor:
        """The micro-batch's share of the step's loss: its loss sum over the step's units, plus
        each auxiliary term `model` reported times its weight over the step's tokens (none in
        evaluation), each term so normalized added to the step's."""
        total = self.loss_sum(outputs, targets) / step.units
        if step.tokens is None:
            return total
        reporter = offered(model)
        for name, value in (reporter.auxiliary_losses or {}).items():
            weight = self.aux_coefficients.get(name, reporter.aux_coefficients.get(name))
            if weight is None:
                raise KeyError(f"{type(model).__name__} reports the auxiliary loss {name!r}: give its weight "
                               f"as objective.aux_coefficients.{name}")
            total = total + weight * value / step.tokens
            step.add(name, value.detach() / step.tokens)
        return total


class NextTokenCrossEntropy(Objective):
    """Cross entropy of logits (batch, seq, vocab) against targets (batch, seq), summed over the
    targets that count (not -100: pre-training counts every token, instruction data its
    responses). Logits the plan leaves sharded on the vocabulary come under torch's loss_parallel,
    which the Trainer enters (once: it does not nest) around forward and backward."""

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE, reduction="sum")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE).sum()

    def count_is_fixed(self, dataset) -> bool:
        return not getattr(dataset, "masked_targets", False)


class MeanSquaredError(Objective):
    """Squared error summed over every output element (the seed's regression)."""

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets, reduction="sum")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.numel(), device=targets.device)


def check_objective(c: Checked) -> None:
    """Before launch: the auxiliary terms' weights name terms the model reports (a mistyped name
    would leave the model's own weight in place), and no weighted term under pipeline
    parallelism (the last stage's loss cannot add a term an earlier stage's module reports; a
    term of weight 0 is only not reported there)."""
    objective_cfg, model, pp_size = c.cfg.objective, c.model, c.roles.pp_size
    reports, declared = offered(model).auxiliary_losses is not None, dict(offered(model).aux_coefficients)
    if reports and pp_size > 1:
        weights = {**declared, **(objective_cfg.get("aux_coefficients") or {})}
        weighted = [(name, weight) for name, weight in weights.items() if weight]
        if weighted:
            name, weight = weighted[0]
            raise ConfigError(f"objective.aux_coefficients.{name}", weight,
                              f"{type(model).__name__} reports this auxiliary loss term, which pipeline "
                              f"parallelism cannot add to the last stage's loss yet; set it to 0 (a mixture of "
                              f"experts can balance with model.moe.bias_update_rate instead), or use a mesh "
                              f"without a pp dim")
    if not reports or not declared:  # a model that declares no weights names its terms only in its forward
        return
    names = sorted(declared)
    for name, weight in (objective_cfg.get("aux_coefficients") or {}).items():
        if name not in names:
            raise ConfigError(f"objective.aux_coefficients.{name}", weight,
                              f"the model reports no such term; it reports: {', '.join(names)}")
