"""Token data that `python -m framework.prepare` wrote once, read memory-mapped (nanoGPT's
token file, Megatron's indexed dataset): map-style, so the DP-derived DistributedSampler and the
exact resume stay as they are.

A prepared directory holds tokens.bin (uint16 or uint32 ids, documents back to back, each
ending with the tokenizer's EOS), doc_offsets.npy (int64: where each document starts, and the
end), mask.bin for instruction data (uint8 per token: 1 where it is a response token to learn),
and meta.json (its kind, dtype, counts, the tokenizer's identity and vocabulary, the inputs).

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
- PromptDataset (kind "prompts"): prompts for online RL, stored as instruction documents (the
  answer, "" when none, where the response is); a sample is the prompt the policy continues,
  the reference answer and the prompt's index in the whole set.
"""
import inspect
import json
import os
import sys
from typing import NamedTuple, Optional

import numpy as np
import torch
from hydra.utils import get_class, instantiate
from torch.utils.data import Dataset, IterableDataset

from framework.config.errors import ConfigError
from framework.config.checked import Checked

FORMAT = "framework-tokens/1"
TOKENS, OFFSETS, MASK, META = "tokens.bin", "doc_offsets.npy", "mask.bin", "meta.json"
LABELS = "labels.bin"  # unpaired preference data: 1 for a desirable example, 0 for an undesirable one
IGNORE = -100  # cross_entropy's ignore_index


def read_meta(path: str, key: str = "data.path") -> dict:
    """The prepared directory's meta.json, or one line naming the path and the fix."""
    if not path:
        raise ConfigError(key, path, "name a directory written by python -m framework.prepare")
    meta_path = os.path.join(os.path.expanduser(path), META)
    if not os.path.isfile(meta_path):
        raise ConfigError(key, path, f"no {META} there: not a directory python -m framework.prepare finished "
                          "writing (prepare writes under a temporary name and renames at the end)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(key, path, f"its format is {meta.get('format')!r}, not {FORMAT!r}; prepare it again")
    return meta


def split_range(count: int, val_fraction: float, split: str) -> tuple:
    """[start, end) of the train or val split of `count` items: val is the last val_fraction."""
    if split not in ("train", "val"):
        raise ConfigError("data.dataset.split", split, "use train or val")
    cut = int(count * (1 - val_fraction))
    return (0, cut) if split == "train" else (cut, count)


def packed_windows(tokens: int, seq_len: int, val_fraction: float, split: str) -> int:
    start, end = split_range(tokens, val_fraction, split)
    return max(0, (end - start - 1) // seq_len)


# Each kind of prepared data: the data= config that reads it, and framework.prepare's flags that make it.
KINDS = {"packed": ("data=tokens", "--text-field FIELD"),
         "instruction": ("data=instructions", "--prompt-field P --response-field R"),
         "preference": ("data=preferences", "--prompt-field P --chosen-field C --rejected-field R"),
         "prompts": ("data=prompts", "--prompt-field P [--answer-field A]"),
         "unpaired": ("data=kto", "--prompt-field P --response-field R --label-field L")}


class PreparedDocuments:
    """A prepared directory's documents: the token stream, where each document starts, and for
    instruction data which tokens are learned. The datasets below read documents through this
    face, so data=hf (framework.data.hf) packs and masks exactly as prepared data does."""

    def __init__(self, path: str, kind: str):
        self.path = os.path.expanduser(path)
        meta = read_meta(path)
        if meta["kind"] != kind:
            given, wanted = KINDS[meta["kind"]], KINDS[kind]
            raise ConfigError("data.path", path, f"holds {meta['kind']} data; this dataset reads {kind} data: prepare "
                                                 f"it again with python -m framework.prepare {wanted[1]} (then "
                                                 f"{wanted[0]}), or read it as it is with {given[0]}")
        self.tokenizer = meta["tokenizer"]  # path, identity, vocab_size, eos_id
        self.stream = np.memmap(os.path.join(self.path, TOKENS), dtype=meta["dtype"], mode="r")
        self.offsets = np.load(os.path.join(self.path, OFFSETS))
        self.learned = np.memmap(os.path.join(self.path, MASK), dtype=np.uint8, mode="r") if kind != "packed" else None

    def tokens(self, begin: int, end: int) -> np.ndarray:
        return self.stream[begin:end].astype(np.int64)

    def mask(self, begin: int, end: int) -> np.ndarray:
        return self.learned[begin:end].astype(np.bool_)

    def learned_at(self, positions: np.ndarray) -> np.ndarray:
        return self.learned[positions] == 1

    def prompt_lengths(self, first: int, end: int) -> np.ndarray:
        """Documents [first, end)'s prompt tokens: the mask's 0s (its 1s come last)."""
        begin, stop = int(self.offsets[first]), int(self.offsets[end])
        responses = np.add.reduceat(self.learned[begin:stop], self.offsets[first:end] - begin, dtype=np.int64)
        return np.diff(self.offsets[first:end + 1]) - responses


class _Documents(Dataset):
    kind = ""

    def _read(self, documents, seq_len: int, split: str, val_fraction: float) -> None:
        self.documents, self.seq_len = documents, seq_len
        self.path = documents.path
        self.vocab_size = documents.tokenizer["vocab_size"]
        self.split, self.val_fraction = split, val_fraction

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


class TokenDataset(_Documents):
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


class InstructionDataset(_Documents):
    kind = "instruction"
    masked_targets = True

    def __init__(self, path: str, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 pad_id: Optional[int] = None):
        self._examples(PreparedDocuments(path, self.kind), seq_len, split, val_fraction, pad_id)

    def _examples(self, documents, seq_len: int, split: str, val_fraction: float, pad_id: Optional[int]) -> None:
        self._read(documents, seq_len, split, val_fraction)
        self.offsets = documents.offsets
        self.first, self.end = split_range(len(self.offsets) - 1, val_fraction, split)
        self.pad_id = documents.tokenizer["eos_id"] if pad_id is None else pad_id
        self._check_not_empty()

    def __len__(self) -> int:
        return self.end - self.first

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
        """Per example, whether cutting it to seq_len + 1 tokens leaves no response token among
        its targets (its tokens after the first). The mask's 1s come last, so the last target
        tells: one byte read per example, not the whole mask."""
        starts, ends = self.offsets[self.first:self.end], self.offsets[self.first + 1:self.end + 1]
        last = starts + np.minimum(self.seq_len, ends - starts - 1)
        return (last == starts) | ~self.documents.learned_at(last)

    def longest_prompt(self) -> int:
        """The seq_len from which every example keeps a response token (at least 1); it reads
        the split's whole mask, so only once some example is known to lose its response."""
        return max(1, int(self.documents.prompt_lengths(self.first, self.end).max()))


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
        docs = InstructionDataset.without_response(self._as_documents())
        return docs[0::2] | docs[1::2]

    def longest_prompt(self) -> int:
        return InstructionDataset.longest_prompt(self._as_documents())

    def _as_documents(self) -> "PreferenceDataset":
        """A view whose first / end count documents (the pairs' two each), for the instruction
        data's checks."""
        view = object.__new__(PreferenceDataset)
        view.__dict__.update(self.__dict__, first=2 * self.first, end=2 * self.end)
        return view


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


class PromptDataset(InstructionDataset):
    """Prompts for online RL (kind "prompts", framework.prepare --prompt-field [--answer-field]):
    sample i is the split's i-th document as a dict of "inputs", the prompt's ids exactly as
    prepare tokenized them (no BOS added, no EOS: what the policy continues), then -100;
    "targets", the reference answer's ids (no EOS), then -100 (all -100 without an answer);
    "index", the document's place in the whole prepared set, the same prompt on any mesh. Both
    are cut to seq_len, which holds a prompt and its completion (longest_prompt says how much
    the prompts take). The last val_fraction of the prompts is held out; pad_id (the
    tokenizer's EOS when None) is kept for the completions, the samples are padded with -100."""
    kind = "prompts"
    masked_targets = True

    def __getitem__(self, index: int) -> dict:
        doc = self.first + index
        begin, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
        prompt = int(self.documents.prompt_lengths(doc, doc + 1)[0])
        tokens = torch.from_numpy(self.documents.tokens(begin, min(end - 1, begin + prompt + self.seq_len)))
        return {"inputs": _padded(tokens[:prompt], self.seq_len), "targets": _padded(tokens[prompt:], self.seq_len),
                "index": torch.tensor(doc, dtype=torch.int64)}

    def without_response(self) -> np.ndarray:
        """(A prompt needs no answer: none is refused for lacking one.)"""
        return np.zeros(len(self), dtype=np.bool_)

    def longest_prompt(self) -> int:
        """The split's longest prompt, in tokens (it reads the split's whole mask)."""
        return int(self.documents.prompt_lengths(self.first, self.end).max())


def _padded(ids: torch.Tensor, length: int) -> torch.Tensor:
    """`ids` cut to `length`, then -100 up to it."""
    out = torch.full((length,), IGNORE, dtype=torch.int64)
    out[:min(len(ids), length)] = ids[:length]
    return out


VOCAB_MULTIPLE = 64  # a padded vocabulary divides by any TP size up to 64 (nanoGPT's 50257 -> 50304)


def kind_of(node) -> Optional[str]:
    """The kind of documents a data.dataset config reads ("packed", "instruction", "preference",
    "unpaired", "prompts"), from its class's `kind` alone (the datasets here, data=hf's, its stream's); None
    for data of another sort (and for a mixture: framework.data.mixture)."""
    target = node.get("_target_") if node is not None else None
    try:
        cls = get_class(target) if target else None
    except Exception:  # (an unknown _target_ is instantiate's error to report)
        return None
    return getattr(cls, "kind", None) if isinstance(cls, type) and issubclass(cls, Dataset) else None


def tokenizer_of(node) -> Optional[dict]:
    """The tokenizer a documents config's tokens come from (meta.json's record of it, or data=hf's
    own), with `source` (where the ids come from) and `max_token_id`; None for other data."""
    if kind_of(node) is None:
        return None
    if "tokenizer" in inspect.signature(get_class(node["_target_"])).parameters:  # data=hf: tokenized as read
        from framework.data.tokenizer import described, load_tokenizer

        if not node.get("tokenizer"):
            raise ConfigError("data.tokenizer", None, "data=hf tokenizes as it reads: name the model's tokenizer.json "
                                                      "(or its directory), or 'bytes'")
        found = described(load_tokenizer(node.tokenizer))
        return {**found, "source": f"the tokenizer {node.tokenizer}", "max_token_id": found["vocab_size"] - 1}
    meta = read_meta(node.path)
    return {**meta["tokenizer"], "source": f"the token data in {node.path}", "max_token_id": meta["max_token_id"]}


def tokens_vocab(path: Optional[str], tokenizer: Optional[str] = None) -> int:
    """`${tokens_vocab:${data.path},${data.tokenizer}}`: the vocabulary of the prepared data at
    `path` (or, for data=hf, of `tokenizer`), rounded up to a multiple of 64 (rows past the
    tokenizer's are never a target)."""
    if tokenizer and not os.path.isfile(os.path.join(os.path.expanduser(path or ""), META)):
        from framework.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(tokenizer).vocab_size
    else:
        vocab = read_meta(path)["tokenizer"]["vocab_size"]
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def check_token_data(cfg) -> None:
    """Before launch, from meta.json (or data=hf's tokenizer) alone: every source's tokens come
    from data.tokenizer (when one is named) and from one tokenizer, and fit model.vocab_size.
    (That each split holds a global batch is framework.validate's check_dataset.)"""
    from framework.data.mixture import source_nodes

    check_sample_sizes(cfg.data.dataset, source_nodes(cfg.data.dataset))
    if cfg.data.get("streaming") and not issubclass(get_class(cfg.data.dataset._target_), IterableDataset):
        raise ConfigError("data.streaming", True, f"{cfg.data.dataset._target_} is read indexed: streaming reads text "
                                                  f"records (data=hf) only; set data.streaming=false")
    named = None
    if cfg.data.get("tokenizer"):
        from framework.data.tokenizer import described, load_tokenizer

        named = described(load_tokenizer(cfg.data.tokenizer))
    found = {name: tokenizer_of(node) for name, node in source_nodes(cfg.data.dataset).items()}
    found = {name: tokenizer for name, tokenizer in found.items() if tokenizer is not None}
    for name, tokenizer in found.items():
        check_pad_id(source_nodes(cfg.data.dataset)[name], tokenizer, name)
        key = f"data.dataset.sources.{name}" if name else "data.tokenizer"
        if named is not None and tokenizer["identity"] != named["identity"]:
            raise ConfigError(key, tokenizer["path"] if name else cfg.data.tokenizer,
                              f"{tokenizer['source']} comes from another tokenizer than data.tokenizer "
                              f"({tokenizer['path']}, vocabulary {tokenizer['vocab_size']}); prepare the data again "
                              f"with {cfg.data.tokenizer}, or name that one")
        first = next(iter(found.values()))
        if tokenizer["identity"] != first["identity"]:
            raise ConfigError(key, tokenizer["path"], f"{tokenizer['source']} and {first['source']} come from different "
                                         f"tokenizers; a model reads one: use the same tokenizer for every source")
        vocab = cfg.model.get("vocab_size")
        if vocab is not None and max(tokenizer["max_token_id"] + 1, tokenizer["vocab_size"]) > vocab:
            raise ConfigError("model.vocab_size", vocab,
                              f"{tokenizer['source']} holds ids up to {tokenizer['max_token_id']} (its tokenizer's "
                              f"vocabulary is {tokenizer['vocab_size']}); use at least {tokenizer['vocab_size']}, e.g. "
                              "${tokens_vocab:${data.path},${data.tokenizer}} as recipes/lm_files.yaml does")


def check_sample_sizes(dataset, sources: dict) -> None:
    """A sample's length and the held-out share, before a dataset divides by them (a seq_len of
    0 ended in a ZeroDivisionError inside Hydra's instantiation)."""
    nodes = {"data.dataset": dataset, **{f"data.dataset.sources.{name}.dataset": node
                                         for name, node in sources.items() if name}}
    for key, node in nodes.items():
        seq_len, fraction = node.get("seq_len"), node.get("val_fraction")
        if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
            raise ConfigError(f"{key}.seq_len", seq_len, "must be an integer >= 1 (tokens per sample)")
        if fraction is not None and (isinstance(fraction, bool) or not 0 <= fraction < 1):
            raise ConfigError(f"{key}.val_fraction", fraction, "must be in [0, 1): the share of the data held out")


def check_pad_id(node, tokenizer: dict, source: str) -> None:
    """A pad id the tokenizer has (completions and examples are padded with it)."""
    pad_id, vocab = node.get("pad_id"), tokenizer["vocab_size"]
    if pad_id is not None and (not isinstance(pad_id, int) or isinstance(pad_id, bool) or not 0 <= pad_id < vocab):
        key = f"data.dataset.sources.{source}.dataset.pad_id" if source else "data.dataset.pad_id"
        raise ConfigError(key, pad_id, f"must be a token id of {tokenizer['path']} (0 to {vocab - 1}), or null "
                                       f"for its EOS")


def check_document_masking(c: Checked) -> None:
    """data.document_masking needs packed token data, which has the documents' boundaries, and a
    model whose forward takes the tokens' positions in their documents."""
    cfg, model = c.cfg, c.model
    dataset = cfg.data.dataset
    masking = bool(cfg.data.get("document_masking")) or bool(dataset.get("document_masking"))
    if not masking:
        return
    from framework.data.mixture import source_nodes

    for node in source_nodes(dataset).values():
        if kind_of(node) != "packed":
            raise ConfigError("data.document_masking", True, f"{node.get('_target_')} has no document boundaries "
                                                             f"(only packed token data, data=tokens or data=hf, has); "
                                                             f"set data.document_masking=false")
    if "positions" not in inspect.signature(type(model).forward).parameters:
        raise ConfigError("data.document_masking", True, f"{type(model).__name__} takes no document positions "
                                                         f"(framework.models.Transformer does); set "
                                                         f"data.document_masking=false")


def check_responses(c: Checked) -> None:
    """Before launch, for instruction data: the examples cut to seq_len keep a response token.
    A split where none does would train (or evaluate) on a loss of 0 at every step: refused.
    Some that do not only add nothing to the loss: one warning line with their count."""
    cfg = c.cfg
    if kind_of(cfg.data.dataset) not in ("instruction", "preference", "unpaired"):
        return
    for split in ("train", "val") if cfg.trainer.eval_every else ("train",):
        data = instantiate(cfg.data.dataset, split=split)
        cut = int(data.without_response().sum())
        if cut:
            _report_cut(data, split, cut)


def _report_cut(data: InstructionDataset, split: str, cut: int) -> None:
    seq_len = data.seq_len
    what = (f"{cut} of the {len(data)} {split} examples in {data.path} keep no response token within "
            f"seq_len+1={seq_len + 1} tokens (their prompts fill it)")
    fix = f"raise it to at least {data.longest_prompt()} (the longest prompt, in tokens) or shorten the prompts"
    if cut == len(data):
        raise ConfigError("data.dataset.seq_len", seq_len, f"{what}, so the loss would be 0 at every step; {fix}")
    print(f"warning: data.dataset.seq_len={seq_len}: {what} and add nothing to the loss; {fix}", file=sys.stderr)
