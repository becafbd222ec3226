"""data=hf, data=hf_instructions, data=hf_preferences: a Hugging Face dataset as users have it
(a `save_to_disk` directory, a folder or file of Parquet / JSONL / JSON / Arrow / CSV, or a Hub
name), read by the `datasets` library and tokenized when a sample is read, in the loader's
workers: no prepare step, no token file.

The samples are exactly those of `framework.prepare` on the same records followed by data=tokens
(or data=instructions / data=preferences): each document is its ids and the tokenizer's EOS,
packed windows of seq_len + 1 tokens start every seq_len tokens of the documents laid end to
end, instruction examples learn the response and its EOS. Random access to a window needs where
each document starts in that stream, so opening a dataset tokenizes it once for its index (each
document's length and, for instruction data, its prompt's), 8 bytes a document, cached under
$FRAMEWORK_CACHE_DIR (default ~/.cache/framework) by the dataset's fingerprint and the
tokenizer's identity: the launcher's checks build it, the ranks and later runs read it.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from framework.config.errors import ConfigError
from framework.data.tokenizer import described, load_tokenizer
from framework.data.datasets import InstructionDataset, PreferenceDataset, TokenDataset
from framework.data.layout import record_documents

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}
SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk writes (a DatasetDict, a Dataset)
INDEX_BATCH = 1024
STREAM_SHARDS = 64  # a save_to_disk dataset streamed: shards the DP ranks and loader workers share out


def _datasets():
    try:
        import datasets  # the `hfdata` extra
    except ImportError:
        raise ConfigError("data", "hf", "reads Hugging Face datasets with the `datasets` package, not installed "
                                        "here; pip install '.[hfdata]'") from None
    datasets.disable_progress_bars()
    return datasets


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def open_dataset(path: Optional[str], split: str = "train", name: Optional[str] = None, streaming: bool = False):
    """The `datasets.Dataset` at `path`: a save_to_disk directory (its `split` when it holds
    several), data files (a file, or a folder's files of one format, sorted), or a Hub name;
    `streaming`: a `datasets.IterableDataset` over it instead, read record by record."""
    if not path:
        raise ConfigError("data.path", path, "name a dataset: a save_to_disk directory, a folder or file of "
                                             ".parquet / .jsonl / .json / .arrow / .csv, or a Hub name")
    datasets = _datasets()
    local = Path(os.path.expanduser(path))
    if local.is_dir() and any((local / marker).is_file() for marker in SAVED):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError("data.split", split, f"{path} holds the splits {sorted(loaded)}; name one of them")
            loaded = loaded[split]
        return loaded.to_iterable_dataset(num_shards=min(len(loaded), STREAM_SHARDS)) if streaming else loaded
    if local.exists():
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.suffix in FORMATS)
        formats = sorted({FORMATS.get(p.suffix) for p in files})
        if not files or None in formats:
            raise ConfigError("data.path", path, f"holds no {' / '.join(FORMATS)} file (nor a save_to_disk dataset)")
        if len(formats) > 1:
            raise ConfigError("data.path", path, f"holds files of several formats ({', '.join(formats)}); give a "
                                                 f"folder of one")
        try:
            return datasets.load_dataset(formats[0], data_files=[str(p) for p in files], split="train",
                                         streaming=streaming)
        except Exception as error:  # a file the format's reader cannot parse
            raise ConfigError("data.path", path, f"cannot be read as {formats[0]}: {_first_line(error)}") from None
    if path.startswith((".", "/", "~")) or path.count("/") > 1:  # a Hub name is NAME or OWNER/NAME
        raise ConfigError("data.path", path, "no such file or directory")
    try:
        return datasets.load_dataset(path, name, split=split, streaming=streaming)
    except Exception as error:  # no network, no such dataset, no such split
        raise ConfigError("data.path", path, f"is no local path, and loading it from the Hugging Face Hub failed: "
                                             f"{_first_line(error)}") from None


def field_keys(count: int) -> List[str]:
    """The config keys naming a record's 1 (text), 2 (instruction) or 3 (preference) fields."""
    names = {1: ["text_field"], 2: ["prompt_field", "response_field"],
             3: ["prompt_field", "chosen_field", "rejected_field"]}[count]
    return [f"data.dataset.{name}" for name in names]


def check_fields(dataset, path: str, fields: Sequence[str]) -> None:
    """Each field is a column of text. A stream whose schema shows only once read (JSON) is
    judged by its first record."""
    if dataset.features is None:
        first = next(iter(dataset.take(1)), {})
        kinds = {name: "string" if isinstance(value, str) else type(value).__name__ for name, value in first.items()}
    else:
        kinds = {name: getattr(feature, "dtype", type(feature).__name__) for name, feature in dataset.features.items()}
    for key, field in zip(field_keys(len(fields)), fields):
        if list(fields).count(field) > 1:
            other = next(k for k, f in zip(field_keys(len(fields)), fields) if f == field and k != key)
            raise ConfigError(key, field, f"is also {other}: a record's parts come from different columns; name "
                                          f"each its own")
        if field not in kinds:
            raise ConfigError(key, field, f"is not a column of {path}; its columns are {list(kinds)}")
        if kinds[field] not in ("string", "large_string"):
            raise ConfigError(key, field, f"is a column of {kinds[field]} in {path}, not of text")


def _cache_dir() -> Path:
    return Path(os.environ.get("FRAMEWORK_CACHE_DIR") or os.path.expanduser("~/.cache/framework")) / "hf_index"


class HFDocuments:
    """A dataset's records as documents (framework.data.token_files.PreparedDocuments' face): a text
    each, or for instruction data prompt + response; preference record i is documents 2i
    (prompt + chosen) and 2i + 1 (prompt + rejected), as framework.prepare lays them out."""

    def __init__(self, path: str, fields: Sequence[str], tokenizer: Optional[str], split: str = "train",
                 name: Optional[str] = None):
        if not tokenizer:
            raise ConfigError("data.tokenizer", tokenizer, "data=hf tokenizes as it reads: name the model's "
                                                           "tokenizer.json (or its directory), or 'bytes'")
        self.path, self.fields = path, list(fields)
        self.dataset = open_dataset(path, split, name)
        check_fields(self.dataset, path, self.fields)
        self.text = load_tokenizer(tokenizer)
        self.tokenizer = described(self.text)
        lengths, self.prompts = self._index()
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._last = (-1, -1, None)

    @property
    def pairs(self) -> bool:
        return len(self.fields) == 3

    def _encode(self, records: dict) -> tuple:
        """Records (columns of lists) as documents: (each one's ids with EOS, each one's prompt length)."""
        return record_documents(self.text, [records[field] for field in self.fields])

    def _index(self) -> tuple:
        """Each document's length and prompt length, from the cache or by tokenizing once."""
        key = hashlib.sha256(json.dumps([self.dataset._fingerprint, self.tokenizer["identity"],
                                         self.tokenizer["eos_id"], self.fields]).encode()).hexdigest()[:32]
        cached = _cache_dir() / f"{key}.npz"
        if cached.is_file():
            with np.load(cached) as saved:
                return saved["lengths"], saved["prompts"] if len(self.fields) > 1 else None
        lengths, prompts = [], []
        for start in range(0, len(self.dataset), INDEX_BATCH):
            docs, prompt_lengths = self._encode(self.dataset[start: start + INDEX_BATCH])
            lengths += map(len, docs)
            prompts += prompt_lengths or []
        lengths, prompts = np.array(lengths, dtype=np.int64), np.array(prompts, dtype=np.int64)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.stem}.{os.getpid()}.partial.npz")
        np.savez(partial, lengths=lengths, prompts=prompts)
        os.replace(partial, cached)  # whole or absent: ranks may build it side by side
        return lengths, prompts if len(self.fields) > 1 else None

    def _documents(self, first: int, last: int) -> np.ndarray:
        """Documents first..last (inclusive) tokenized, end to end; the last call's are kept (an
        instruction example reads its tokens, then its mask)."""
        if self._last[:2] != (first, last):
            per_record = 2 if self.pairs else 1
            records = self.dataset[first // per_record: last // per_record + 1]
            docs, _ = self._encode(records)
            skip = first - first // per_record * per_record
            self._last = (first, last, np.fromiter((t for d in docs[skip: skip + last - first + 1] for t in d),
                                                   dtype=np.int64))
        return self._last[2]

    def _document_of(self, positions):
        return np.searchsorted(self.offsets, positions, side="right") - 1

    def tokens(self, begin: int, end: int) -> np.ndarray:
        first, last = int(self._document_of(begin)), int(self._document_of(end - 1))
        start = int(self.offsets[first])
        return self._documents(first, last)[begin - start: end - start]

    def learned_at(self, positions: np.ndarray) -> np.ndarray:
        docs = self._document_of(positions)
        return positions - self.offsets[docs] >= self.prompts[docs]

    def mask(self, begin: int, end: int) -> np.ndarray:
        return self.learned_at(np.arange(begin, end))

    def prompt_lengths(self, first: int, end: int) -> np.ndarray:
        return self.prompts[first:end]


class HFTokenDataset(TokenDataset):
    """data=hf: the `text_field` of each record, packed as data=tokens packs prepared text."""

    def __init__(self, path: str, tokenizer: Optional[str], text_field: str = "text", hf_split: str = "train",
                 name: Optional[str] = None, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 document_masking: bool = False):
        documents = HFDocuments(path, [text_field], tokenizer, hf_split, name)
        self._windows(documents, seq_len, split, val_fraction, document_masking)


class HFInstructionDataset(InstructionDataset):
    """data=hf_instructions: prompt + response records, one example each, the prompt masked."""

    def __init__(self, path: str, tokenizer: Optional[str], prompt_field: str = "prompt",
                 response_field: str = "response", hf_split: str = "train", name: Optional[str] = None,
                 seq_len: int = 128, split: str = "train", val_fraction: float = 0.05, pad_id: Optional[int] = None):
        documents = HFDocuments(path, [prompt_field, response_field], tokenizer, hf_split, name)
        self._examples(documents, seq_len, split, val_fraction, pad_id)


class HFPreferenceDataset(PreferenceDataset):
    """data=hf_preferences: prompt, chosen and rejected records, one pair each (DPO)."""

    def __init__(self, path: str, tokenizer: Optional[str], prompt_field: str = "prompt",
                 chosen_field: str = "chosen", rejected_field: str = "rejected", hf_split: str = "train",
                 name: Optional[str] = None, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 pad_id: Optional[int] = None):
        documents = HFDocuments(path, [prompt_field, chosen_field, rejected_field], tokenizer, hf_split, name)
        self._examples(documents, seq_len, split, val_fraction, pad_id)
