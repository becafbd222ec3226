"""What a run holds as the builder's stages fill it in (framework.training.builder), and what
the loop reads. Its own module, so the builder and the loop both import it and not each other."""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig


@dataclass
class Run:
    cfg: DictConfig
    out_dir: str
    rank: int = 0
    mesh: Any = None
    dp: Dict[str, int] = field(default_factory=dict)  # {"size", "rank"} of the DP role
    tp: Dict[str, int] = field(default_factory=dict)
    model: Any = None
    dataset: Any = None
    sampler: Any = None
    dataloader: Any = None
    val_dataloader: Any = None  # only with trainer.eval_every
    loss_fn: Any = None
    optimizer: Any = None
    scheduler: Any = None
    checkpointer: Any = None  # framework.checkpoint.manager.Checkpointer
    resumed: Any = None  # framework.checkpoint.manager.Resumed, when the run continues a checkpoint
    summary: Optional[dict] = None
