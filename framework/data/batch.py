"""One batch as the step consumes it: inputs, targets and, for packed windows of several
documents (data.document_masking) or under context parallelism, each token's position in its
document, which the model takes as a keyword (framework.models.documents)."""
from typing import List, NamedTuple, Optional, Sequence

import torch


class Batch(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, sample: Sequence[torch.Tensor], device) -> "Batch":
        """A loader's batch (2 or 3 tensors) on `device`."""
        return cls(*(t.to(device) for t in sample))

    def split(self, size: int) -> List["Batch"]:
        """Micro-batches of `size` sequences."""
        parts = [t.split(size) for t in self if t is not None]
        return [Batch(*tensors) for tensors in zip(*parts)]

    def model_inputs(self) -> dict:
        """The model's keyword inputs besides the tokens."""
        return {} if self.positions is None else {"positions": self.positions}
