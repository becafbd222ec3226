"""Per-token and per-sequence log-probabilities, from logits or from a loss head's result
(framework.training.objectives.chunked_loss): what DPO / SimPO / KTO sum per sequence and GRPO
reads per token, and the LM objective's summed cross entropy."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import register_dataclass

from framework.data.batch import IGNORE


@dataclass
class LossSum:
    """A head's summed cross entropy (the LM objective's loss sum)."""
    value: torch.Tensor


@dataclass
class TokenLogps:
    """A head's per-token log-probabilities, in the targets' shape (0 where a target is -100)."""
    values: torch.Tensor


register_dataclass(LossSum)
register_dataclass(TokenLogps)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's log-probability (rows, seq); 0 where the target is -100. `logits` are
    (rows, seq, vocab), or (count, vocab) at the targets that count alone, in row order (the
    OutputHead's select), or an OutputHead's TokenLogps by chunks."""
    if isinstance(logits, TokenLogps):
        return logits.values
    if logits.dim() == 2:
        counted = targets != IGNORE
        token = F.cross_entropy(logits.float(), targets[counted], reduction="none")
        return torch.zeros(targets.shape, dtype=token.dtype, device=token.device).masked_scatter(counted, -token)
    token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return -token.view(targets.shape)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross entropy of logits (rows, seq, vocab) against targets (rows, seq)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE, reduction="sum")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per sequence, the sum of its targets' log-probabilities (targets -100 left out); with
    `average`, their mean (SimPO's length normalization; 0 for a sequence without targets).
    `logits` as token_logps takes them."""
    total = token_logps(logits, targets).sum(-1)
    return total / response_lengths(targets) if average else total


def response_lengths(targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's count of targets that count, at least 1 (TRL's clamp)."""
    return (targets != IGNORE).sum(-1).clamp(min=1)


