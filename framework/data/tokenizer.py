"""Tokenizers a run or `framework.prepare` can name: a `tokenizer.json` (the file a Hugging Face
model directory ships, read by the `tokenizers` package) or the byte-level one (vocabulary 256,
what framework.data.ByteCorpus trains on).

Each has an identity (a hash of its definition) and a vocabulary size that prepared token data
records, so data prepared with one tokenizer is refused before launch for a model or tokenizer
that does not match. The end-of-text id separates documents when they are packed.
"""
import hashlib
import json
import os
from typing import List, Optional, Sequence

from framework.config.errors import ConfigError

BYTE_LEVEL = "bytes"
# Special tokens tokenizer.json files commonly end a text with, tried in this order when no
# tokenizer_config.json beside it names the EOS token: a document's end (Llama 3, GPT-2 / Qwen,
# Llama 2 / Mistral, Gemma, others) before a chat turn's (ChatML's <|im_end|>).
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens. Its end of text is byte 0 (NUL), which text does not contain."""
    vocab_size = 256
    eos_id: Optional[int] = 0
    bos_id: Optional[int] = None
    identity = "bytes"
    path = BYTE_LEVEL

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A `tokenizers` tokenizer.json. BOS / EOS come from tokenizer_config.json beside it (as an
    HF model directory has it), else from the special tokens it defines; `eos_token` overrides."""

    def __init__(self, path: str, eos_token: Optional[str] = None):
        from tokenizers import Tokenizer  # the `data` extra: only runs that name a tokenizer need it

        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read()
            self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as error:  # unreadable, not UTF-8, not a tokenizer definition
            raise ConfigError("tokenizer", path, f"cannot be read as a tokenizer.json: {_first_line(error)}") from None
        self.identity = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        named = _special_tokens_named_beside(path)
        self.bos_id = self._id(named.get("bos_token"))
        self.eos_id = self._id(eos_token or named.get("eos_token"))
        if eos_token and self.eos_id is None:
            raise ConfigError("eos_token", eos_token, f"is not a token of {path}")
        if self.eos_id is None:
            self.eos_id = self._first_special(EOS_CANDIDATES)

    def _id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _first_special(self, names: Sequence[str]) -> Optional[int]:
        """The id of the first of `names` that is one of its special tokens: a plain vocabulary
        piece that happens to be spelled `</s>` ends no text."""
        special = {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        return next((special[name] for name in names if name in special), None)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # no BOS / EOS added here: documents are joined by the EOS id explicitly
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _special_tokens_named_beside(path: str) -> dict:
    """bos_token / eos_token of a tokenizer_config.json in the same directory (a string, or a
    dict with "content" as older files have it)."""
    config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError("tokenizer", config_path, f"cannot be read as JSON: {_first_line(error)}") from None
    if not isinstance(config, dict):
        raise ConfigError("tokenizer", config_path, "is not a JSON object")
    named = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        named[key] = value.get("content") if isinstance(value, dict) else value
    return named


def described(tokenizer) -> dict:
    """What prepared data records of its tokenizer (meta.json's "tokenizer"), and data=hf reports."""
    return {"path": os.path.abspath(tokenizer.path) if tokenizer.path != BYTE_LEVEL else BYTE_LEVEL,
            "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id}


def load_tokenizer(path: Optional[str], eos_token: Optional[str] = None):
    """`bytes` (or None): the byte-level tokenizer; else a tokenizer.json, or a directory holding
    one (an HF model directory)."""
    if path in (None, BYTE_LEVEL):
        return ByteTokenizer()
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError("tokenizer", path, "no such file; name a tokenizer.json, a directory holding one, "
                          f"or {BYTE_LEVEL!r} for the byte-level tokenizer")
    return FileTokenizer(path, eos_token)
