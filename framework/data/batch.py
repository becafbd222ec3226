"""One batch as the step consumes it: inputs, targets and, for packed windows of several
documents (data.document_masking) or under context parallelism, each token's position in its
document, which the model takes as a keyword (framework.models.documents); for DPO with
objective.reference=precomputed, each pair's reference log-probabilities; from a mixture
(framework.data.mixture), each sample's source; for GRPO (framework.training.objectives.grpo), each prompt's
index in its dataset (what seeds its sampling) and, once its completions are rolled out, each
completion's advantage (the reference's per-token log-probabilities in `reference`, and with
objective.num_iterations > 1 the policy's as it generated, `old_logps`; with its sampling
correction each completion token's log-probability as the decoder drew it, `sampled_logps`); for a vision-language
model (framework.data.vision), each sample's images padded to the batch's most (`pixels`), how
many are real (`image_counts`) and, where its processor gives them, each token's type
(`token_types`: image or text)."""
from typing import List, NamedTuple, Optional, Sequence

import torch

IGNORE = -100  # a target that counts in no loss (cross_entropy's ignore_index)


class Batch(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor] = None
    reference: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None
    index: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_logps: Optional[torch.Tensor] = None
    sampled_logps: Optional[torch.Tensor] = None
    pixels: Optional[torch.Tensor] = None
    image_counts: Optional[torch.Tensor] = None
    token_types: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, sample: Sequence[torch.Tensor], device) -> "Batch":
        """A loader's batch (2 or 3 tensors, or a named tuple or dict of this class's fields) on `device`."""
        if hasattr(sample, "_asdict"):
            sample = sample._asdict()
        if isinstance(sample, dict):
            return cls(**{name: t.to(device) for name, t in sample.items()})
        return cls(*(t.to(device) for t in sample))

    def split(self, size: int) -> List["Batch"]:
        """Micro-batches of `size` samples."""
        names = [name for name in self._fields if getattr(self, name) is not None]
        parts = [getattr(self, name).split(size) for name in names]
        return [Batch(**dict(zip(names, tensors))) for tensors in zip(*parts)]

    def model_inputs(self) -> dict:
        """The model's keyword inputs besides the tokens."""
        names = ("positions", "pixels", "image_counts", "token_types")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
