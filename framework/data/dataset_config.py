"""What a data.dataset config reads, known before any dataset is built: the kind of documents,
the tokenizer its tokens come from, the vocabulary a model needs for them."""
import inspect
import os
from typing import Optional

from hydra.utils import get_class
from torch.utils.data import Dataset

from framework.config.errors import ConfigError
from framework.data.token_files import META, read_meta
from framework.data.tokenizer import described, load_tokenizer

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
    parameters = inspect.signature(get_class(node["_target_"])).parameters
    if "processor" in parameters:  # (data=vision_preferences: the model directory's processor makes its tokens)
        return None
    if "tokenizer" in parameters:  # data=hf: tokenized as read
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
    if not path and not tokenizer:
        raise ConfigError("data.tokenizer", None, "the model's vocabulary (model.vocab_size) comes from the prepared "
                                                  "data at data.path or from data.tokenizer, and neither is given "
                                                  "(data=mixture has no data.path: its sources name their own); name "
                                                  "the tokenizer the data was prepared with: data.tokenizer=PATH "
                                                  "(a tokenizer.json or its directory) or bytes")
    if tokenizer and not os.path.isfile(os.path.join(os.path.expanduser(path or ""), META)):
        vocab = load_tokenizer(tokenizer).vocab_size
    else:
        vocab = read_meta(path)["tokenizer"]["vocab_size"]
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
