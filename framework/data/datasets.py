"""The datasets over prepared documents (framework.data.token_files, or data=hf's documents
read the same way: framework.data.hf): map-style, so the DP-derived DistributedSampler and the
exact resume stay as they are.

- TokenDataset (kind "packed"): pre-training windows of seq_len + 1 tokens packed across
  documents, sample i starting at token i * seq_len; the last val_fraction is held out.
- InstructionDataset (kind "instruction"): one example per document, cut to seq_len + 1 tokens,
  targets -100 (ignored) on prompt tokens and on padding; the last val_fraction of the examples
  is held out; an example's mask is its prompt's 0s, then its response's 1s. Its
  `masked_targets` tells the lm objective that not every target counts, so the step counts the
  response tokens of the whole global batch (framework.training.objectives, trainer).
- PreferenceDataset (kind "preference"): two instruction examples per sample, DPO's pairs.
- UnpairedPreferenceDataset (kind "unpaired"): instruction examples, each labelled desirable or
  not (labels.bin, uint8 per example), KTO's data.
(PromptDataset, kind "prompts": framework.data.prompts.)
"""
import os
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from framework.config.errors import ConfigError
from framework.data.batch import IGNORE
from framework.data.token_files import LABELS, PreparedDocuments, packed_windows, split_range


class DocumentsDataset(Dataset):
    """What every dataset over documents holds: the documents, the sample length, the split."""
    kind = ""

    def _read(self, documents, seq_len: int, split: str, val_fraction: float) -> None:
        self.documents, self.seq_len = documents, seq_len
        self.path = documents.path
        self.vocab_size = documents.tokenizer["vocab_size"]
        self.split, self.val_fraction = split, val_fraction

    def _examples(self, documents, seq_len: int, split: str, val_fraction: float, pad_id: Optional[int]) -> None:
        """One sample per document: the split's documents [first, end), padded with pad_id (the
        tokenizer's EOS when None)."""
        self._read(documents, seq_len, split, val_fraction)
        self.offsets = documents.offsets
        self.first, self.end = split_range(len(self.offsets) - 1, val_fraction, split)
        self.pad_id = documents.tokenizer["eos_id"] if pad_id is None else pad_id
        self._check_not_empty()

    def _check_not_empty(self) -> None:
        if len(self) == 0:
            path, split, seq_len = self.path, self.split, self.seq_len
            raise ConfigError("data.path", path, f"its {split} split holds no sample of seq_len+1={seq_len + 1} "
                              "tokens; prepare more data or use a shorter seq_len")


def positions_in_documents(document_starts: np.ndarray, begin: int, length: int) -> torch.Tensor:
    """Each token's place in its document, for the tokens [begin, begin + length) of a stream
    whose documents start at `document_starts` (sorted). The window's first token is at 0
    whatever the document it cuts into: the window holds none of that document's earlier tokens."""
    index = np.arange(begin, begin + length)
    starts = document_starts[np.searchsorted(document_starts, index, side="right") - 1]
    return torch.from_numpy(index - np.maximum(starts, begin))


class TokenDataset(DocumentsDataset):
    """With `document_masking` each sample also carries its tokens' positions in their documents
    (framework.models.documents): a token attends to its own document only, and its rotary
    angle counts from the document's start. The target of a document's last token (its EOS) is
    the next document's first token, predicted from the ending document alone (torchtitan keeps
    these targets too)."""
    kind = "packed"

    def __init__(self, path: str, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 document_masking: bool = False):
        self._windows(PreparedDocuments(path, self.kind), seq_len, split, val_fraction, document_masking)

    def _windows(self, documents, seq_len: int, split: str, val_fraction: float, document_masking: bool) -> None:
        self._read(documents, seq_len, split, val_fraction)
        self.start, _ = split_range(int(documents.offsets[-1]), val_fraction, split)
        self.document_starts = documents.offsets[:-1] if document_masking else None
        self._check_not_empty()

    def __len__(self) -> int:
        return packed_windows(int(self.documents.offsets[-1]), self.seq_len, self.val_fraction, self.split)

    def __getitem__(self, index: int):
        begin = self.start + index * self.seq_len
        window = torch.from_numpy(self.documents.tokens(begin, begin + self.seq_len + 1))
        if self.document_starts is None:
            return window[:-1], window[1:]
        return window[:-1], window[1:], positions_in_documents(self.document_starts, begin, self.seq_len)


class ExamplesDataset(DocumentsDataset):
    """Prepared data of one kind whose samples are its split's documents, one each (instruction
    examples, prompts), their targets masked where nothing is learnt."""
    kind: str
    masked_targets = True

    def __init__(self, path: str, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 pad_id: Optional[int] = None):
        self._examples(PreparedDocuments(path, self.kind), seq_len, split, val_fraction, pad_id)

    def __len__(self) -> int:
        return self.end - self.first


class InstructionDataset(ExamplesDataset):
    kind = "instruction"

    def __getitem__(self, index: int):
        return self.example(self.first + index)

    def example(self, doc: int):
        """Document `doc` as (inputs, targets): its prompt's and padding's targets ignored."""
        begin, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
        end = min(end, begin + self.seq_len + 1)
        return self._inputs_and_targets(self.documents.tokens(begin, end), self.documents.mask(begin, end))

    def _inputs_and_targets(self, tokens: np.ndarray, learn: np.ndarray):
        """Tokens (at most seq_len + 1) and which are learned as (inputs, targets), padded to seq_len."""
        tokens, learn = torch.from_numpy(tokens), torch.from_numpy(learn)
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE, dtype=torch.int64)
        inputs[: len(tokens) - 1] = tokens[:-1]
        targets[: len(tokens) - 1] = torch.where(learn[1:], tokens[1:], IGNORE)
        return inputs, targets

    def without_response(self) -> np.ndarray:
        """Per example, whether cutting it to seq_len + 1 tokens leaves no response token."""
        return without_response(self.documents, self.first, self.end, self.seq_len)

    def longest_prompt(self) -> int:
        """The seq_len from which every example keeps a response token (at least 1); it reads
        the split's whole mask, so only once some example is known to lose its response."""
        return max(1, int(self.documents.prompt_lengths(self.first, self.end).max()))


def without_response(documents, first: int, end: int, seq_len: int) -> np.ndarray:
    """Per document of [first, end), whether cutting it to seq_len + 1 tokens leaves no response
    token among its targets (its tokens after the first). The mask's 1s come last, so the last
    target tells: one byte read per document, not the whole mask."""
    starts, ends = documents.offsets[first:end], documents.offsets[first + 1:end + 1]
    last = starts + np.minimum(seq_len, ends - starts - 1)
    return (last == starts) | ~documents.learned_at(last)


class PreferencePair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    reference: torch.Tensor


class PreferenceDataset(InstructionDataset):
    """Preference pairs (kind "preference", framework.prepare --chosen-field --rejected-field):
    pair i is documents 2i (prompt + chosen) and 2i + 1 (prompt + rejected), one sample of
    inputs and targets (2, seq_len) each, so the sampler, the DP split and micro-batches never
    part a pair. The last val_fraction of the pairs is held out. With `reference` (DPO's
    precomputed reference log-probabilities, (pairs, 2)) a sample also carries its pair's."""
    kind = "preference"
    masked_targets = True

    def _examples(self, documents, seq_len: int, split: str, val_fraction: float, pad_id: Optional[int]) -> None:
        super()._examples(documents, seq_len, split, val_fraction, pad_id)
        pairs = (len(self.offsets) - 1) // 2
        self.first, self.end = split_range(pairs, val_fraction, split)
        self.reference: Optional[np.ndarray] = None
        self._check_not_empty()

    def __getitem__(self, index: int):
        pair = self.first + index
        (chosen, chosen_targets), (rejected, rejected_targets) = self.example(2 * pair), self.example(2 * pair + 1)
        inputs, targets = torch.stack([chosen, rejected]), torch.stack([chosen_targets, rejected_targets])
        if self.reference is None:
            return inputs, targets
        return PreferencePair(inputs, targets, torch.from_numpy(self.reference[index]))

    def without_response(self) -> np.ndarray:
        """Per pair, whether cutting it to seq_len + 1 tokens leaves either response no token."""
        docs = without_response(self.documents, 2 * self.first, 2 * self.end, self.seq_len)
        return docs[0::2] | docs[1::2]

    def longest_prompt(self) -> int:
        """The seq_len from which both examples of every pair keep a response token (at least 1)."""
        return max(1, int(self.documents.prompt_lengths(2 * self.first, 2 * self.end).max()))


class UnpairedPreferenceDataset(InstructionDataset):
    """Unpaired preference data (kind "unpaired", framework.prepare --prompt-field --response-field
    --label-field), KTO's: one example per document, labelled desirable or undesirable. Sample i
    is a dict of "inputs" and "targets" (2, seq_len): row 0 the example, row 1 its prompt with
    another example's response (the split's previous one, the first taking the last), for the
    objective's KL estimate; and "index", the example's place in the whole prepared set, by which
    the objective reads its label (`labels`, the whole set's; the batch carries no label field).
    TRL's KTOTrainer rotates the responses the same way, within each chunk of
    per_device_train_batch_size examples read in order; here batches are shuffled and a replica's
    share depends on the mesh, so the pairing is the split's, the same on every mesh. The last
    val_fraction of the examples is held out; with `reference` (precomputed reference
    log-probabilities, (examples, 2)) a sample also carries its two rows'."""
    kind = "unpaired"
    masked_targets = True

    def _examples(self, documents, seq_len: int, split: str, val_fraction: float, pad_id: Optional[int]) -> None:
        super()._examples(documents, seq_len, split, val_fraction, pad_id)
        self.labels = np.memmap(os.path.join(self.path, LABELS), dtype=np.uint8, mode="r")
        self.reference: Optional[np.ndarray] = None

    def __getitem__(self, index: int) -> dict:
        doc = self.first + index
        other = self.first + (index - 1) % len(self)
        rows = [self.example(doc), self.mismatched(doc, other)]
        sample = {"inputs": torch.stack([r[0] for r in rows]), "targets": torch.stack([r[1] for r in rows]),
                  "index": torch.tensor(doc, dtype=torch.int64)}
        if self.reference is not None:
            sample["reference"] = torch.from_numpy(self.reference[index])
        return sample

    def mismatched(self, doc: int, other: int):
        """Document `doc`'s prompt with document `other`'s response, as `example` makes a document."""
        prompt, other_prompt = (int(self.documents.prompt_lengths(d, d + 1)[0]) for d in (doc, other))
        begin, response = int(self.offsets[doc]), int(self.offsets[other]) + other_prompt
        tokens = np.concatenate([self.documents.tokens(begin, begin + prompt),
                                 self.documents.tokens(response, int(self.offsets[other + 1]))])[:self.seq_len + 1]
        return self._inputs_and_targets(tokens, np.arange(len(tokens)) >= prompt)

