"""The records `python -m framework.prepare` reads: JSONL lines and Parquet rows field by field,
.txt files as UTF-8 text; a bad one is named by its file and line (or row) in one line."""
import json
from pathlib import Path
from typing import Iterator, List, Optional

from framework.config.errors import ConfigError


class InputError(ConfigError):
    """Bad input data: the file (and line) and what is wrong with it."""

    def __init__(self, where: str, problem: str):
        ValueError.__init__(self, f"input error: {where}: {problem}")


def _jsonl_problem(line: bytes, fields: List[str], not_empty: List[str] = (), flags: List[str] = ()):
    """(the record's values, None) or (None, what is wrong with the line)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except json.JSONDecodeError:
        return None, "not JSON"
    missing = fields if not isinstance(record, dict) else [field for field in fields if field not in record]
    if missing:
        return None, f"has no field {_named(missing)}"
    values = [record[field] for field in fields]
    wrong = _wrong_type(fields, values, flags)
    if wrong:
        return None, f"its {wrong[0]!r} is not {wrong[2]}"
    empty = _empty(not_empty, record)
    if empty:
        return None, f"its {_named(empty)} is empty"
    return values, None


def _empty(fields: List[str], record: dict) -> List[str]:
    return [field for field in fields if record[field] == ""]


def _wrong_type(fields: List[str], values: list, flags: List[str]) -> Optional[tuple]:
    """The first value of the wrong type (a flag's is true or false, the others' text) as (the
    field, the value, what it should be), or None."""
    for field, value in zip(fields, values):
        if not isinstance(value, bool if field in flags else str):
            return field, value, "true or false" if field in flags else "a string"
    return None


def _named(fields: List[str]) -> str:
    return " / ".join(map(repr, fields))


def jsonl_records(path: Path, fields: List[str], not_empty: List[str], flags: List[str], skip_bad: bool,
                   skipped: List[int]) -> Iterator:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            values, problem = _jsonl_problem(line, fields, not_empty, flags)
            if problem and skip_bad:
                skipped[0] += 1
                skipped[1:] = skipped[1:] or [f"{path}:{number} {problem}"]  # the first, for "nothing was left"
                continue
            if problem:
                raise InputError(f"{path}:{number}", f"{problem}; fix it, or pass --skip-bad-lines to skip and "
                                 "count such lines")
            yield values if len(values) > 1 else values[0]


def parquet_records(path: Path, fields: List[str], not_empty: List[str], flags: List[str]) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq  # the `data` extra

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise InputError(str(path), f"cannot be read as Parquet: {' '.join(str(error).split())}") from None
    missing = [field for field in fields if field not in parquet.schema_arrow.names]
    if missing:
        raise InputError(str(path), f"has no column {missing[0]!r}; its columns are {parquet.schema_arrow.names}")
    row = 0
    for batch in parquet.iter_batches(columns=fields, batch_size=1024):
        for values in zip(*(batch.column(field).to_pylist() for field in fields)):
            wrong = _wrong_type(fields, values, flags)
            if wrong:
                raise InputError(f"{path}: row {row}", f"its {wrong[0]!r} is not {wrong[2]} ({wrong[1]!r})")
            empty = _empty(not_empty, dict(zip(fields, values)))
            if empty:
                raise InputError(f"{path}: row {row}", f"its {_named(empty)} is empty")
            row += 1
            yield list(values) if len(values) > 1 else values[0]


def txt_lines(path: Path) -> Iterator[str]:
    """A .txt's non-blank lines (split as text mode splits them), read as bytes so that bytes
    that are not UTF-8 are named by their offset in the file."""
    start = 0
    with open(path, "rb") as f:
        for line in f:
            yield from (text for text in utf8_text(line, path, start).split("\n") if text.strip())
            start += len(line)


def utf8_text(data: bytes, path: Path, start: int = 0) -> str:
    """`data` (at byte `start` of `path`) as UTF-8 with text mode's newlines, or one line naming
    the byte: replaced bytes would train on U+FFFD, and the same bytes in .jsonl are refused."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: byte {start + error.start}", "not UTF-8; convert the file to UTF-8 (e.g. "
                         "iconv -f latin1 -t utf-8)") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")
