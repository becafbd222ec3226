"""Prompts for online RL (kind "prompts"): a dataset of its own kind, whose targets are the
reference answers a reward compares with, not tokens the loss learns."""
import torch

from framework.data.batch import IGNORE
from framework.data.datasets import ExamplesDataset


class PromptDataset(ExamplesDataset):
    """Prompts for online RL (kind "prompts", framework.prepare --prompt-field [--answer-field]):
    sample i is the split's i-th document as a dict of "inputs", the prompt's ids exactly as
    prepare tokenized them (no BOS added, no EOS: what the policy continues), then -100;
    "targets", the reference answer's ids (no EOS), then -100 (all -100 without an answer);
    "index", the document's place in the whole prepared set, the same prompt on any mesh. Both
    are cut to seq_len, which holds a prompt and its completion (longest_prompt says how much
    the prompts take). The last val_fraction of the prompts is held out; pad_id (the
    tokenizer's EOS when None) is kept for the completions, the samples are padded with -100."""
    kind = "prompts"

    def __getitem__(self, index: int) -> dict:
        doc = self.first + index
        begin, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
        prompt = int(self.documents.prompt_lengths(doc, doc + 1)[0])
        tokens = torch.from_numpy(self.documents.tokens(begin, min(end - 1, begin + prompt + self.seq_len)))
        return {"inputs": _padded(tokens[:prompt], self.seq_len), "targets": _padded(tokens[prompt:], self.seq_len),
                "index": torch.tensor(doc, dtype=torch.int64)}

    def longest_prompt(self) -> int:
        """The split's longest prompt, in tokens (it reads the split's whole mask)."""
        return int(self.documents.prompt_lengths(self.first, self.end).max())


def _padded(ids: torch.Tensor, length: int) -> torch.Tensor:
    """`ids` cut to `length`, then -100 up to it."""
    out = torch.full((length,), IGNORE, dtype=torch.int64)
    out[:min(len(ids), length)] = ids[:length]
    return out
