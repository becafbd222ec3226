"""Models a config can name (`_target_: framework.models.SeedMLP`); any torch.nn module works too."""
from framework.models.seed import SeedMLP
from framework.models.transformer import Transformer

__all__ = ["SeedMLP", "Transformer"]
