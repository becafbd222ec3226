"""How records become documents: the one layout `python -m framework.prepare` writes and data=hf
(framework.data.hf) reads. A text is its ids and the tokenizer's EOS; a [prompt, response]
record (prompts data's [prompt, answer] too) is prompt + response + EOS, its prompt's tokens
not learned, so a prompt is exactly its ids; a [prompt, chosen, rejected] record is the two
documents prompt + chosen and prompt + rejected; a [prompt, response, label] record is
[prompt, response] and its label (1 desirable, 0 not). No BOS is added anywhere."""
from typing import List, Optional, Sequence, Tuple

import numpy as np


def record_documents(tokenizer, columns: Sequence[Sequence[str]]) -> Tuple[List[List[int]], Optional[List[int]]]:
    """Records given as columns, texts (1), prompts and responses (2) or prompts, chosen and
    rejected (3), as documents: (each one's ids with EOS, each one's prompt length or None)."""
    eos = tokenizer.eos_id
    encoded = [tokenizer.encode_batch(column) for column in columns]
    if len(encoded) == 1:
        return [ids + [eos] for ids in encoded[0]], None
    prompts = [p for p in encoded[0] for _ in encoded[1:]]
    responses = [r for record in zip(*encoded[1:]) for r in record]
    return [p + r + [eos] for p, r in zip(prompts, responses)], [len(p) for p in prompts]


def encode_records(tokenizer, kind: str, chunk: list) -> tuple:
    """A chunk of records of prepare's `kind` as (tokens, per-document lengths, mask or None,
    labels or None): the mask 1 on each response and its EOS."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    labels = None
    if kind == "unpaired":
        labels = np.array([label for *_, label in chunk], dtype=np.uint8)
        chunk = [[prompt, response] for prompt, response, _ in chunk]
    columns = [chunk] if kind == "packed" else [list(column) for column in zip(*chunk)]
    docs, prompt_lengths = record_documents(tokenizer, columns)
    mask = None if prompt_lengths is None else np.concatenate(
        [np.r_[np.zeros(p, np.uint8), np.ones(len(doc) - p, np.uint8)] for doc, p in zip(docs, prompt_lengths)])
    tokens = np.fromiter((t for doc in docs for t in doc), dtype=np.int64)
    return tokens.astype(dtype), np.array([len(doc) for doc in docs], dtype=np.int64), mask, labels
