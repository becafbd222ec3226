"""data=mixture: several sources (data=tokens, data=instructions, data=hf, ... configs), each
drawn with a weight.

The mixture is map-style, so the DP sampler, the DP split and the exact resume stay as they are:
its sample k is a function of (seed, weights, k) alone. Sample k's source is drawn from the
weights by a generator seeded with (seed, split, k // BLOCK); it is that source's j-th draw,
which reads the source's sample j mod its length (a source shorter than its share starts over:
its epoch ends inside the mixture's, and the next pass is the same function of j). So the sample
sequence is the same on every mesh, and a checkpoint's global position (epoch, samples) is all a
resume needs, whatever source was at an epoch end.

torchdata's MultiNodeWeightedSampler draws on each rank from that rank's own nodes with a
rank-seeded generator: the global batch would depend on the DP size, and resuming on another
mesh could not continue it. Hence this index function instead.
"""
import inspect
import math
from functools import lru_cache
from typing import Optional

import numpy as np
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, IterableDataset

from framework.config.errors import ConfigError
from framework.config.checked import instantiate_checked

BLOCK = 4096  # samples whose sources one generator draws
SPLITS = {"train": 0, "val": 1}


@lru_cache(maxsize=8)
def _drawn(seed: int, split: int, block: int, weights: tuple) -> np.ndarray:
    """The sources of samples [block * BLOCK, (block + 1) * BLOCK)."""
    return np.random.default_rng([seed, split, block]).choice(len(weights), size=BLOCK, p=np.array(weights))


def source_nodes(node) -> dict:
    """A data.dataset config's sources by name: a mixture's, or the dataset itself as ''."""
    if node is None or node.get("_target_") not in MIXTURES:
        return {"": node}
    return {name: source.get("dataset") for name, source in (node.get("sources") or {}).items()}


class Mixture(Dataset):
    """`sources`: name -> {weight, dataset: a dataset config}. seq_len and document_masking
    are the mixture's, given to every source. `num_samples`: the mixture's epoch (null: the
    sources' samples summed). Each sample is a dict, its `source` the source's place in
    `names`, which the metrics count tokens by (TensorBoard's data/share/NAME)."""

    def __init__(self, sources: DictConfig, seq_len: int, split: str = "train", document_masking: bool = False,
                 seed: int = 0, num_samples: Optional[int] = None):
        if not sources:
            raise ConfigError("data.dataset.sources", None, "name at least one source: NAME: {weight: W, dataset: "
                                                            "{_target_: ..., ...}}")
        self.source_names = list(sources)
        weights = np.array([_weight(name, sources[name]) for name in self.source_names], dtype=np.float64)
        if weights.sum() <= 0:
            raise ConfigError("data.dataset.sources", [float(w) for w in weights], "the weights are all 0; give a "
                                                                                   "source a positive weight")
        self.weights = tuple(float(w) for w in weights / weights.sum())
        self.sources = [_instantiate(name, sources[name], seq_len=seq_len, split=split,
                                     document_masking=document_masking) for name in self.source_names]
        for name, source in zip(self.source_names, self.sources):
            if isinstance(source, IterableDataset):
                raise ConfigError(f"data.dataset.sources.{name}.dataset", type(source).__name__,
                                  "a streamed source has no sample j to draw; mix it indexed (HFTokenDataset)")
        kinds = {type(source).kind if hasattr(type(source), "kind") else None for source in self.sources}
        self.masked_targets = any(getattr(source, "masked_targets", False) for source in self.sources)
        if len(kinds) > 1:
            raise ConfigError("data.dataset.sources", self.source_names, f"mix sources of one kind (packed text, or "
                                                                  f"instruction examples); these are {sorted(map(str, kinds))}")
        self.seq_len, self.seed, self.split = seq_len, seed, SPLITS[split]
        self.size = num_samples if num_samples is not None else sum(len(source) for source in self.sources)
        self.counts = self._counts()

    def _counts(self) -> np.ndarray:
        """Per block, how many samples before it each source had drawn."""
        blocks = -(-self.size // BLOCK)
        counts = np.zeros((blocks + 1, len(self.sources)), dtype=np.int64)
        for block in range(blocks):
            drawn = _drawn(self.seed, self.split, block, self.weights)
            counts[block + 1] = counts[block] + np.bincount(drawn, minlength=len(self.sources))
        return counts

    def __len__(self) -> int:
        return self.size

    def draw(self, index: int) -> tuple:
        """(source, j) of mixture sample `index`: its source's j-th draw."""
        block, offset = divmod(index, BLOCK)
        drawn = _drawn(self.seed, self.split, block, self.weights)
        source = int(drawn[offset])
        return source, int(self.counts[block, source]) + int((drawn[:offset] == source).sum())

    def locate(self, index: int) -> tuple:
        """(source, its sample) of mixture sample `index`."""
        source, j = self.draw(index)
        return source, j % len(self.sources[source])

    def __getitem__(self, index: int) -> dict:
        source, sample = self.locate(index)
        names = ("inputs", "targets", "positions")
        return {**dict(zip(names, self.sources[source][sample])), "source": torch.tensor(source)}


MIXTURES = ("framework.data.Mixture", f"{__name__}.Mixture")


def _weight(name: str, source) -> float:
    weight = source.get("weight") if isinstance(source, (dict, DictConfig)) else None
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"data.dataset.sources.{name}.weight", weight, "give each source a finite weight >= 0")
    return float(weight)


def _instantiate(name: str, source, **given) -> Dataset:
    node = source.get("dataset")
    if not isinstance(node, (dict, DictConfig)) or "_target_" not in node:
        raise ConfigError(f"data.dataset.sources.{name}.dataset", node, "give the source's dataset config, "
                                                                        "with its _target_ (as conf/data/*.yaml)")
    if node["_target_"] in MIXTURES:
        raise ConfigError(f"data.dataset.sources.{name}.dataset", node["_target_"], "a source cannot be a mixture")

    accepted = inspect.signature(get_class(node["_target_"])).parameters
    node = OmegaConf.create(OmegaConf.to_container(node, resolve=True)) if isinstance(node, DictConfig) else node
    return instantiate_checked(node, **{key: value for key, value in given.items() if key in accepted})
