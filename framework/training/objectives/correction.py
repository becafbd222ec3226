"""objective.sampling_correction (framework.training.objectives.grpo): truncated importance
sampling (TIS; TRL's vLLM correction) between the policy that learns and the policy whose decoder
drew the completion's tokens.

Each completion token's weight is w = min(exp(learner - sampler), sampling_cap), where `sampler`
is the token's log-probability as the decoder drew it (framework.models.decode: the softmax at
`temperature`, renormalized over the top-p nucleus) and `learner` the same distribution's under
the policy as it learns this step, from the loss's own logits (no forward more: with one update
a rollout, the learning forward is the policy's). With max_staleness 0 both are the same weights
and w is 1 up to the two computations' rounding (the decoder's KV cache sums in another order);
with K > 0 the sampler was the policy K updates before, and w corrects for it. Both sides use the
sampling's own support: a token outside the learner's nucleus gets weight 0, never the full
softmax's (the top-p bias TRL's users report). The loss multiplies each token's term by w.
"""
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from framework.data.batch import IGNORE
from framework.parallel.dtensors import is_dtensor, whole
from framework.training.objectives.logps import TokenLogps, token_logps

CORRECTION_METRICS = ("sampling/ratio_mean", "sampling/ratio_max", "sampling/truncated")


def plain_sampling(temperature: float, top_p: float) -> bool:
    """Whether the decoder draws from the softmax itself (temperature 1, or greedy, and no nucleus):
    then the learner's log-probabilities are the loss's own."""
    return temperature in (0.0, 1.0) and top_p >= 1


def sampling_logps(logits, targets: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Each target's log-probability (rows, seq; 0 where it is -100) under the distribution the
    decoder samples from: softmax(logits / temperature), over the nucleus of top_p (next_tokens'
    rule: the most likely tokens until their sum reaches top_p), renormalized; -inf for a target
    outside it. `logits` as token_logps takes them."""
    if plain_sampling(temperature, top_p):
        return token_logps(logits, targets)
    if isinstance(logits, TokenLogps) or is_dtensor(logits):
        raise ValueError("the sampling's own distribution needs whole logits on the rank")
    counted = targets != IGNORE
    rows = (logits if logits.dim() == 2 else logits[counted]).float() / (temperature or 1.0)
    chosen = targets[counted]
    if top_p >= 1:
        token = -F.cross_entropy(rows, chosen, reduction="none")
    else:
        probs, order = torch.softmax(rows, -1).sort(-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0)
        kept = torch.zeros_like(probs).scatter(-1, order, probs)
        token = (kept.gather(-1, chosen[:, None])[:, 0] / kept.sum(-1)).log()
    return torch.zeros(targets.shape, dtype=token.dtype, device=token.device).masked_scatter(counted, token)


def truncated_weights(learner: torch.Tensor, sampler: torch.Tensor, targets: torch.Tensor,
                      cap: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Each counted token's min(exp(learner - sampler), cap) (0 elsewhere), and sums of the ratio
    before truncation over these tokens: its sum, its largest value and how many were truncated."""
    learner = whole(learner)
    counted = targets != IGNORE
    ratio = torch.exp(learner.detach().float() - sampler.float()).masked_fill(~counted, 0)
    sums = {"sum": ratio.sum(), "max": ratio.max(), "truncated": ((ratio > cap) & counted).sum().float()}
    return ratio.clamp(max=cap), sums
