"""`python -m framework.prepare INPUTS... --out DIR [--tokenizer PATH]`: tokenize your text once
into the memory-mapped format training reads (framework.data.token_files).

INPUTS are files or directories (their files, recursively, in sorted order; files of other
kinds are skipped and named in one line): `.txt` (one document per file, or per line with
--txt-lines), `.jsonl` (the --text-field of each line) and `.parquet` (the --text-field column,
read in record batches), all UTF-8. With --prompt-field and --response-field, JSONL / Parquet
records become instruction examples whose prompt tokens are masked out of the loss; with
--prompt-field, --chosen-field and --rejected-field, preference pairs (DPO): each record's prompt +
chosen and prompt + rejected, two instruction examples side by side; with --prompt-field,
--response-field and --label-field, unpaired preference data (KTO): instruction examples, each
record's label (true: desirable, false: undesirable) in labels.bin; with --prompt-field alone (and
optionally --answer-field), prompts for online RL (GRPO): each record's prompt + answer ("" without
--answer-field), stored as an instruction example, its prompt non-empty. Documents keep their
input order; each ends with the tokenizer's EOS (after the response or answer, never in a prompt).

Memory stays bounded as inputs grow: records stream in chunks, at most two chunks per worker
are in flight, and tokens are appended to the file as they come (only document offsets stay in
memory, 8 bytes each). Everything is written under `DIR.partial-<pid>` and renamed to DIR at the
end, so an interrupted prepare leaves nothing that looks complete. Bad input exits 2 with one
line naming the file (and line).
"""
import argparse
import functools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers is the parallelism

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from framework.data.layout import encode_records  # noqa: E402
from framework.data.records import InputError, jsonl_records, parquet_records, txt_lines, utf8_text  # noqa: E402
from framework.data.token_files import FORMAT, LABELS, MASK, META, OFFSETS, TOKENS  # noqa: E402
from framework.data.tokenizer import EOS_CANDIDATES, described, load_tokenizer  # noqa: E402

SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK_CHARS = 1 << 20  # about 1 MB of text per task


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m framework.prepare", description=__doc__.split("\n\n")[0],
                                     exit_on_error=False)
    parser.add_argument("inputs", nargs="+", help="files or directories (.txt, .jsonl, .parquet)")
    parser.add_argument("--out", required=True, help="the directory to create (must not exist)")
    parser.add_argument("--tokenizer", default="bytes", help="a tokenizer.json, a directory holding one, "
                        "or 'bytes' (byte-level, the default)")
    parser.add_argument("--eos-token", help="the token that ends a document (default: the tokenizer's EOS)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column of the text")
    parser.add_argument("--txt-lines", action="store_true", help=".txt: one document per line, not per file")
    parser.add_argument("--prompt-field", help="instruction data: the prompt's field / column")
    parser.add_argument("--response-field", help="instruction data: the response's field / column")
    parser.add_argument("--chosen-field", help="preference data: the preferred response's field / column")
    parser.add_argument("--rejected-field", help="preference data: the other response's field / column")
    parser.add_argument("--label-field", help="unpaired preference data (KTO, with --prompt-field and "
                        "--response-field): the field / column saying whether the response is desirable "
                        "(true / false)")
    parser.add_argument("--answer-field", help="prompts data (with --prompt-field alone): a reference answer's "
                        "field / column, for a reward that compares")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="JSONL lines that are not JSON, lack a field or (prompts data) leave the prompt "
                        "empty: skip and count them")
    args = parser.parse_args(argv)
    pairs = args.chosen_field is not None or args.rejected_field is not None
    if args.answer_field is not None and (args.prompt_field is None or args.response_field is not None or pairs):
        raise InputError("--prompt-field / --answer-field", "give --answer-field with --prompt-field alone, for "
                         "prompts data (no --response-field, --chosen-field or --rejected-field)")
    if pairs and (args.prompt_field is None or args.chosen_field is None or args.rejected_field is None
                  or args.response_field is not None):
        raise InputError("--prompt-field / --chosen-field / --rejected-field",
                         "give all three for preference data (and no --response-field)")
    if args.label_field is not None and (args.response_field is None or pairs or args.answer_field is not None):
        raise InputError("--label-field", "give it with --prompt-field and --response-field, for unpaired "
                         "preference data (no --chosen-field, --rejected-field or --answer-field)")
    if args.response_field is not None and args.prompt_field is None:
        raise InputError("--prompt-field / --response-field", "give both for instruction data (--prompt-field "
                         "alone is prompts data)")
    if args.workers < 1:
        raise InputError("--workers", f"{args.workers}: use 1 or more")
    return args


def input_files(inputs: Iterable[str]) -> List[Path]:
    files = []
    for name in inputs:
        path = Path(name).expanduser()
        if not path.exists():
            raise InputError(name, "no such file or directory")
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        kept = [p for p in found if p.suffix in SUFFIXES]
        if not kept:
            raise InputError(name, f"holds no {', '.join(SUFFIXES)} file")
        _say_skipped(name, [p.relative_to(path) for p in found if p.suffix not in SUFFIXES])
        files += kept
    return files


def _say_skipped(directory: str, skipped: List[Path], shown: int = 3) -> None:
    """One line for a directory's files of other kinds: a file left out in silence looks like
    data that was tokenized."""
    if skipped:
        names = ", ".join(map(str, skipped[:shown])) + (", ..." if len(skipped) > shown else "")
        print(f"skipped {len(skipped)} file{'s' * (len(skipped) > 1)} in {directory} (not {', '.join(SUFFIXES)}): "
              f"{names}", file=sys.stderr)


def kind(args: argparse.Namespace) -> str:
    """What the inputs become (meta.json's kind): packed text, instruction examples, preference
    pairs, unpaired preference examples, or prompts."""
    if not args.prompt_field:
        return "packed"
    if args.label_field:
        return "unpaired"
    return "preference" if args.chosen_field else "instruction" if args.response_field else "prompts"


def _fields(args: argparse.Namespace) -> List[str]:
    if args.chosen_field:
        return [args.prompt_field, args.chosen_field, args.rejected_field]
    if kind(args) == "prompts":
        return [args.prompt_field] + ([args.answer_field] if args.answer_field else [])
    if args.label_field:
        return [args.prompt_field, args.response_field, args.label_field]
    return [args.prompt_field, args.response_field] if args.prompt_field else [args.text_field]


def _flags(args: argparse.Namespace) -> List[str]:
    """The fields that hold true or false (unpaired data's label), not text."""
    return [args.label_field] if args.label_field else []


def _not_empty(args: argparse.Namespace) -> List[str]:
    """The fields a record must not leave empty: a prompt to continue, for prompts data (an empty
    prompt gives the policy nothing to condition on)."""
    return [args.prompt_field] if kind(args) == "prompts" else []

def records(files: List[Path], args: argparse.Namespace, skipped: List[int]) -> Iterator:
    """Every document (a text, [prompt, response], [prompt, chosen, rejected], unpaired data's
    [prompt, response, label], or prompts data's [prompt, answer]) of the inputs, in order."""
    read = _records(files, args, skipped)
    if kind(args) == "prompts" and not args.answer_field:
        return ([prompt, ""] for prompt in read)
    return read


def _records(files: List[Path], args: argparse.Namespace, skipped: List[int]) -> Iterator:
    for path in files:
        if path.suffix == ".jsonl":
            yield from jsonl_records(path, _fields(args), _not_empty(args), _flags(args), args.skip_bad_lines, skipped)
        elif path.suffix == ".parquet":
            yield from parquet_records(path, _fields(args), _not_empty(args), _flags(args))
        elif args.prompt_field:
            raise InputError(str(path), "instruction, preference and prompts data come from .jsonl or .parquet, "
                             "not .txt")
        elif args.txt_lines:
            yield from txt_lines(path)
        else:
            yield utf8_text(path.read_bytes(), path)



def chunked(items: Iterator, chars: int = CHUNK_CHARS) -> Iterator[list]:
    chunk, size = [], 0
    for item in items:
        chunk.append(item)
        size += len(item) if isinstance(item, str) else sum(len(value) for value in item if isinstance(value, str))
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_tokenizer = None  # each worker's, loaded once


def _load(path: str, eos_token: Optional[str]) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(path, eos_token)


def tokenize(kind: str, chunk: list) -> tuple:
    """A chunk of `kind` records as documents, in this worker (framework.data.layout)."""
    return encode_records(_tokenizer, kind, chunk)


@contextmanager
def killable_children() -> Iterator[None]:
    """Processes forked inside start with SIGTERM's default action, whatever handler this process
    has (torch's elastic agent, run in-process, installs one): a forked worker stuck on a lock
    another thread held at the fork never runs a Python handler, and Pool.terminate's SIGTERM
    must end it rather than leave the pool's join waiting forever (a suite run once hung there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ordered_map(function: Callable, items: Iterator, workers: int, initializer: Callable, initargs: tuple) -> Iterator:
    """function over items, results in order, with at most 2 items per worker in flight
    (Pool.imap would read all of `items` ahead)."""
    if workers == 1:
        initializer(*initargs)
        yield from map(function, items)
        return
    with killable_children():
        pool = multiprocessing.get_context("fork").Pool(workers, initializer, initargs)
    with pool:
        pending = deque()
        for item in items:
            pending.append(pool.apply_async(function, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize the inputs into args.out; return its meta.json."""
    out = Path(args.out).expanduser()
    if out.exists():
        raise InputError(str(out), "already exists; remove it or choose another --out")
    files = input_files(args.inputs)
    tokenizer = load_tokenizer(args.tokenizer, args.eos_token)
    if tokenizer.eos_id is None:
        raise InputError(args.tokenizer, "defines no end-of-text token to separate documents (no eos_token in a "
                         "tokenizer_config.json beside it, no special token named " + ", ".join(EOS_CANDIDATES) +
                         "); name one with --eos-token")
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        meta = _write(files, args, tokenizer, partial)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _write(files: List[Path], args: argparse.Namespace, tokenizer, partial: Path) -> dict:
    skipped, lengths, count, largest = [0], [np.zeros(1, dtype=np.int64)], 0, -1
    start = time.perf_counter()
    progress = tqdm(unit=" docs", desc="prepare", disable=None)
    instruction, desirable = bool(args.prompt_field), 0
    with open(partial / TOKENS, "wb") as tokens_file, open(partial / MASK, "wb") if instruction else \
            open(os.devnull, "wb") as mask_file, open(partial / LABELS, "wb") if args.label_field else \
            open(os.devnull, "wb") as labels_file:
        encoded = ordered_map(functools.partial(tokenize, kind(args)), chunked(records(files, args, skipped)),
                              args.workers, _load, (args.tokenizer, args.eos_token))
        for tokens, doc_lengths, mask, labels in encoded:
            tokens.tofile(tokens_file)
            if mask is not None:
                mask.tofile(mask_file)
            if labels is not None:
                labels.tofile(labels_file)
                desirable += int(labels.sum())
            lengths.append(doc_lengths)
            count += len(tokens)
            largest = max(largest, int(tokens.max()))
            progress.update(len(doc_lengths))
            progress.set_postfix(tokens_per_s=f"{count / (time.perf_counter() - start):.0f}")
    progress.close()
    offsets = np.cumsum(np.concatenate(lengths))
    if len(offsets) == 1:
        raise InputError(" ".join(args.inputs), "holds no document" if not skipped[0] else _all_skipped(args, skipped))
    np.save(partial / OFFSETS, offsets)
    meta = {
        "format": FORMAT, "kind": kind(args),
        "dtype": "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32",
        "tokenizer": described(tokenizer),
        "documents": len(offsets) - 1, "tokens": count, "max_token_id": largest, "skipped_lines": skipped[0],
        "inputs": [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in files],
        "seconds": time.perf_counter() - start,
        **({"desirable": desirable} if args.label_field else {}),
    }
    (partial / META).write_text(json.dumps(meta, indent=2))
    return meta


def _all_skipped(args: argparse.Namespace, skipped: list) -> str:
    """Every line skipped (--skip-bad-lines): the first one's problem, and the flag that names a field."""
    flags = {getattr(args, f"{name}_field"): f"--{name}-field" for name in ("text", "prompt", "response", "chosen",
                                                                           "rejected", "label", "answer")}
    missing = [field for field in _fields(args) if "has no field" in skipped[1] and repr(field) in skipped[1]]
    fix = f"name the field your records hold with {flags[missing[0]]}" if missing else "fix the lines"
    return f"--skip-bad-lines skipped every line ({skipped[0]}; the first: {skipped[1]}); {fix}"


# What a user gave, per kind: a preference pair is two documents ([prompt, chosen], [prompt, rejected]).
GIVEN = {"packed": ("documents", 1), "instruction": ("examples", 1), "preference": ("pairs", 2),
         "unpaired": ("examples", 1), "prompts": ("prompts", 1)}


def main(argv: List[str]) -> int:
    from framework.cli import command_status

    def body() -> int:
        try:
            args = parse_args(argv)
        except argparse.ArgumentError as error:
            raise InputError("arguments", str(error)) from None
        meta = prepare(args)
        unit, documents = GIVEN[meta["kind"]]
        print(f"prepared {meta['documents'] // documents} {unit}, {meta['tokens']} tokens ({meta['kind']}, "
              f"{meta['dtype']}) into {args.out}" + (f"; skipped {meta['skipped_lines']} bad lines"
                                                      if meta["skipped_lines"] else ""))
        return 0

    try:
        return command_status(body, "prepare failed")
    except KeyboardInterrupt:
        print("prepare interrupted; nothing was written to --out", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
