"""Datasets (config `_target_`s: framework.data.SyntheticRegression, framework.data.RandomTokens, framework.data.ByteCorpus,
framework.data.TokenDataset, framework.data.InstructionDataset,
framework.data.PreferenceDataset, framework.data.UnpairedPreferenceDataset, framework.data.PromptDataset,
framework.data.HFTokenDataset, framework.data.HFInstructionDataset, framework.data.HFPreferenceDataset,
framework.data.HFTokenStream, framework.data.Mixture), the tokenizers framework.prepare and runs name (framework.data.tokenizer),
and the DP-derived sampler and loader over them (framework.data.loader)."""
from framework.data.corpus import ByteCorpus
from framework.data.synthetic import RandomTokens, SyntheticRegression
from framework.data.hf import HFInstructionDataset, HFPreferenceDataset, HFTokenDataset
from framework.data.mixture import Mixture
from framework.data.stream import HFTokenStream
from framework.data.datasets import InstructionDataset, PreferenceDataset, TokenDataset, UnpairedPreferenceDataset
from framework.data.prompts import PromptDataset

__all__ = ["ByteCorpus", "HFInstructionDataset", "HFPreferenceDataset", "HFTokenDataset", "HFTokenStream", "InstructionDataset",
           "Mixture", "PreferenceDataset", "PromptDataset", "RandomTokens", "SyntheticRegression", "TokenDataset",
           "UnpairedPreferenceDataset"]
