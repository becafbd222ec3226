"""objective=lm and objective=mse: the unit a target token that counts, an output element."""
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from framework.data.batch import IGNORE
from framework.training.objectives.base import Objective
from framework.training.objectives.head import OutputHead
from framework.training.objectives.logps import LossSum, cross_entropy_sum


class NextTokenCrossEntropy(Objective):
    """Cross entropy of logits (batch, seq, vocab) against targets (batch, seq), summed over the
    targets that count (not -100: pre-training counts every token, instruction data its
    responses). Logits the plan leaves sharded on the vocabulary come under torch's loss_parallel,
    which the Trainer enters (once: it does not nest) around forward and backward. With
    trainer.loss_chunk_tokens its OutputHead sums it by chunks of tokens instead of logits
    (framework.training.objectives.head: LossSum)."""
    kind = "lm"

    def __init__(self, aux_coefficients: Optional[Mapping[str, float]] = None):
        super().__init__(aux_coefficients)
        self.head = OutputHead()  # (setup: every position, by trainer.loss_chunk_tokens' chunks)

    def setup(self, context) -> None:
        self.head = context.head.every_position()

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        return self.head(model, batch.inputs, batch.targets, per_token=False, **batch.model_inputs())

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        return outputs.value if isinstance(outputs, LossSum) else cross_entropy_sum(outputs, targets)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE).sum()

    def count_is_fixed(self, dataset) -> bool:
        return not getattr(dataset, "masked_targets", False)


class MeanSquaredError(Objective):
    """Squared error summed over every output element (the seed's regression)."""
    kind = "mse"

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets, reduction="sum")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.numel(), device=targets.device)
