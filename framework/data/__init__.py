"""Datasets (config `_target_`s: framework.data.SyntheticRegression, framework.data.ByteCorpus)
and the DP-derived sampler and loader over them (framework.data.loader)."""
from framework.data.corpus import ByteCorpus
from framework.data.synthetic import SyntheticRegression

__all__ = ["ByteCorpus", "SyntheticRegression"]
