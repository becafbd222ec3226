"""Datasets (config `_target_`s: framework.data.SyntheticRegression, framework.data.RandomTokens, framework.data.ByteCorpus,
framework.data.TokenDataset, framework.data.InstructionDataset,
framework.data.PreferenceDataset), the tokenizers framework.prepare
and runs name (framework.data.tokenizer), and the DP-derived sampler and loader over them
(framework.data.loader)."""
from framework.data.corpus import ByteCorpus
from framework.data.synthetic import RandomTokens, SyntheticRegression
from framework.data.tokens import InstructionDataset, PreferenceDataset, TokenDataset

__all__ = ["ByteCorpus", "InstructionDataset", "PreferenceDataset", "RandomTokens", "SyntheticRegression",
           "TokenDataset"]
