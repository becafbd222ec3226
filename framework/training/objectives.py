"""What a step optimizes: the `objective` config group (conf/objective/).

An objective scores one micro-batch as the SUM of its per-unit losses (a unit: a target token
that counts, an output element; later a preference pair) and says how many units a batch's
targets hold. The step's loss is the global sum over the global count, however the units fall
on DP replicas, micro-batches and pipeline stages (framework.training.trainer.Normalization):
that is what makes every mesh train the model one process trains, masked data included.

A model may report auxiliary terms for a micro-batch (a mixture of experts' load-balancing loss):
any submodule whose forward sets `auxiliary_losses = {name: sum over the micro-batch's units}`.
The objective adds each times its coefficient (`objective.aux_coefficients`) to the sum, so the
same normalization keeps them mesh-independent, and keeps their values for logging.
"""
from contextlib import nullcontext
from typing import Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from framework.data.tokens import IGNORE


class Objective:
    """Base: `loss_sum(outputs, targets)` and `count(targets)` per objective; the auxiliary terms
    and their coefficients are common to all."""

    def __init__(self, aux_coefficients: Optional[Mapping[str, float]] = None):
        self.aux_coefficients = dict(aux_coefficients or {})
        self.terms: Dict[str, torch.Tensor] = {}  # the last micro-batch's auxiliary sums (detached)
        self._reporters: Optional[List[nn.Module]] = None

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """How many units these targets hold (a 0-dim tensor)."""
        raise NotImplementedError

    def count_is_fixed(self, dataset) -> bool:
        """Whether every unit of `dataset`'s batches counts, so a batch's count follows from its
        shape and the global count needs no communication."""
        return True

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """The micro-batch's loss sum plus each auxiliary term `model` reported times its coefficient."""
        total = self.loss_sum(outputs, targets)
        if self._reporters is None:  # found once: walking every module each micro-batch costs
            self._reporters = [module for module in model.modules() if hasattr(module, "auxiliary_losses")]
        self.terms = {}
        for module in self._reporters:
            for name, value in (module.auxiliary_losses or {}).items():
                if name not in self.aux_coefficients:
                    raise KeyError(f"{type(module).__name__} reports the auxiliary loss {name!r}: give its weight "
                                   f"as objective.aux_coefficients.{name}")
                total = total + self.aux_coefficients[name] * value
                self.terms[name] = self.terms.get(name, 0.0) + value.detach()
        return total


class NextTokenCrossEntropy(Objective):
    """Cross entropy of logits (batch, seq, vocab) against targets (batch, seq), summed over the
    targets that count (not -100: pre-training counts every token, instruction data its
    responses). Logits the plan leaves sharded on the vocabulary get torch's loss_parallel."""

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        sharded = isinstance(outputs, DTensor) and outputs.placements[0].is_shard(outputs.ndim - 1)
        with loss_parallel() if sharded else nullcontext():
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
