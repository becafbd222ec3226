"""What an objective may know of the run it optimizes: the builder's objective stage hands it an
ObjectiveContext once the weights are final (framework.training.builder.stage_objective), never
the run itself. Typed and small: the objective reads its options and the data's from `cfg`, and
the rest from here."""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig
from torch import nn

from framework.parallel.device import Device
from framework.training.objectives.head import OutputHead


@dataclass(frozen=True)
class Group:
    """A set of ranks this rank works with: its size, this rank's place, the process group (None
    where it is one rank or needs none)."""
    size: int = 1
    rank: int = 0
    group: Any = None


@dataclass(frozen=True)
class ObjectiveContext:
    cfg: DictConfig                    # the run's config: objective.*, data.*, trainer.* options
    device: Device
    module: nn.Module                  # the policy, bare: its ModelProtocol (output layer, hf_path, adapters)
    model: nn.Module                   # what the loop calls (DataParallel's wrapper under replicate)
    head: OutputHead                   # how the policy's forwards meet its output layer
    dataset: Any = None                # the training split (its tokenizer, pad id, labels)
    val_dataset: Any = None            # the held-out split, with trainer.eval_every
    replicas: Group = field(default_factory=Group)  # the DP x CP replicas a global batch is split over
    samples: Group = field(default_factory=Group)   # the replicas the sampler deals samples to (torchft's too)
    tp: Group = field(default_factory=Group)
    reference_model: Optional[nn.Module] = None  # objective.reference=frozen_copy's, built by the builder
    out_dir: str = ""
    rank: int = 0
    resumed: bool = False              # the run continues a checkpoint
