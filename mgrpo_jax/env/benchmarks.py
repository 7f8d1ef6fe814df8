"""Loaders for the real benchmarks' on-disk formats, as their publishers ship them (each described below).

- `load_gaia(path)`: a split folder or a metadata file, `metadata.jsonl` (older layout, `Level` an
  integer) or `metadata.parquet` / `metadata.levelN.parquet` (current layout, `Level` a string, extra
  `file_path`). Attachments resolve from `file_name` (beside the metadata) or `file_path` (from the
  repository root). Test-split answers `"?"` load as `answer=None`.
- `load_xbench(path)`: the DeepSearch CSV (`utf-8-sig`), each encrypted field decrypted with its own
  row's canary (repeating-key XOR over base64).
- `load_webwalker(path)`: the JSONL with the real lower-case schema; also the capitalised
  documentation variant and the flattened JSON-array variant.

A malformed file raises `BenchmarkFormatError` (a `ValueError`) naming the file, the line or row, and the
problem: a missing file, one with no records, bytes that are not UTF-8 text, invalid or too deeply nested JSON,
a record missing a required field. A loader either returns every record (at least one) or raises, never a
partial list. Decrypted XBench text is never put in an error message (the maintainers ask that it not be
published). `load_benchmark(name, path)` is the loader of a benchmark by name.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GAIA, XBENCH, WEBWALKER = "gaia", "xbench", "webwalker"
GAIA_UNLABELLED = "?"
XBENCH_COLUMNS = ("id", "prompt", "answer", "reference_steps", "canary")
MAX_JSON_DEPTH = 100  # where an error locates JSON too deeply nested to parse (real records nest 3 deep)


class BenchmarkFormatError(ValueError):
    """A benchmark file does not have the expected format; the message says where and why."""

    def __init__(self, path: Path | str, location: str, problem: str):
        super().__init__(f"{path}: {location}: {problem}")
        self.path, self.location, self.problem = str(path), location, problem


@dataclass(frozen=True)
class BenchmarkRecord:
    id: str
    question: str
    answer: str | None  # None when the gold answer is withheld (GAIA test split)
    benchmark: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    attachment: Path | None = None  # GAIA: the resolved attachment path (may be absent on disk)
    root_url: str | None = None  # WebWalkerQA: the site the agent starts from


# ---------------------------------------------------------------- GAIA


def _gaia_metadata_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise BenchmarkFormatError(path, "path", "no such file or folder")
    for name in ("metadata.jsonl", "metadata.parquet"):
        if (path / name).is_file():
            return path / name
    raise BenchmarkFormatError(path, "folder", "has neither metadata.jsonl nor metadata.parquet")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise BenchmarkFormatError(path, "file", f"cannot open ({error.strerror or error})") from None


def _line_and_column(data: bytes, index: int, first_line: int = 1) -> tuple[int, int]:
    """Where byte `index` of `data` (which starts at `first_line` of its file) is: line and column, 1-based."""
    before = data[:index]
    line = first_line + before.count(b"\n") + (before.count(b"\r") - before.count(b"\r\n"))
    return line, index - max(before.rfind(b"\n"), before.rfind(b"\r"))


def _decode(path: Path, data: bytes, encoding: str = "utf-8", first_line: int = 1) -> str:
    """`data` (from `first_line` of `path` on) as text; a NUL byte or bytes that are not UTF-8 (a binary file)
    as a `BenchmarkFormatError` naming the line and column."""
    nul = data.find(b"\x00")
    if nul >= 0:
        line, column = _line_and_column(data, nul, first_line)
        raise BenchmarkFormatError(path, f"line {line}", f"not text (a NUL byte at column {column}; a binary file?)")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        line, column = _line_and_column(error.object, error.start, first_line)
        raise BenchmarkFormatError(path, f"line {line}", f"not UTF-8 text (byte 0x{error.object[error.start]:02x} "
                                   f"at column {column}; a binary file?)") from None


def _json_depth_line(text: str, limit: int = MAX_JSON_DEPTH) -> int | None:
    """The line (1-based, within `text`) where JSON arrays and objects first nest deeper than `limit`."""
    depth, line, in_string, escaped = 0, 1, False, False
    for char in text:
        if char == "\n":
            line += 1
        elif in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return line
        elif char in "]}":
            depth -= 1
    return None


def _parse_json(path: Path, text: str, first_line: int = 1) -> Any:
    """`json.loads(text)`, its failures as `BenchmarkFormatError`s naming the line (`text` starts at `first_line`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BenchmarkFormatError(path, f"line {first_line + error.lineno - 1}",
                                   f"invalid JSON ({error.msg})") from None
    except RecursionError:  # json recurses once per level: ~1000 levels exhaust the interpreter's limit
        line = first_line + (_json_depth_line(text) or 1) - 1
        raise BenchmarkFormatError(path, f"line {line}",
                                   f"JSON nested too deeply (over {MAX_JSON_DEPTH} levels)") from None


def _read_jsonl(path: Path, data: bytes | None = None) -> list[tuple[str, Any]]:
    """(location, parsed JSON) of each non-blank line of `path` (its bytes `data` if already read)."""
    rows = []
    data = _read_bytes(path) if data is None else data
    for line_number, raw in enumerate(data.splitlines(), start=1):
        line = _decode(path, raw, "utf-8-sig" if line_number == 1 else "utf-8", line_number)
        if line.strip():
            rows.append((f"line {line_number}", _parse_json(path, line, line_number)))
    return rows


def _some(path: Path, records: list[BenchmarkRecord], empty: str = "an empty file") -> list[BenchmarkRecord]:
    if not records:
        raise BenchmarkFormatError(path, "file", f"no records ({empty})")
    return records


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet  # only GAIA's current layout needs it

    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as error:  # pyarrow raises its own zoo of types for unreadable files
        raise BenchmarkFormatError(path, "file", f"not a readable Parquet file ({error})") from None
    return [(f"row {index}", row) for index, row in enumerate(table.to_pylist())]


def _require_string(path: Path, location: str, row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        problem = "missing" if key not in row else f"must be a string, got {type(value).__name__}"
        raise BenchmarkFormatError(path, location, f"field {key!r} {problem}")
    return value


def _gaia_level(path: Path, location: str, value: Any) -> int:
    # JSONL stores Level as an integer, Parquet as a string.
    if isinstance(value, bool):
        value = None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or value not in (1, 2, 3):
        raise BenchmarkFormatError(path, location, f"field 'Level' must be 1, 2 or 3, got {value!r}")
    return value


def _gaia_attachment(split_dir: Path, file_name: str, file_path: str) -> Path | None:
    if file_path:
        # file_path is relative to the repository root: the first ancestor where it exists is that root.
        for root in (split_dir, *split_dir.parents):
            if (root / file_path).exists():
                return root / file_path
        return split_dir / Path(file_path).name
    return split_dir / file_name if file_name else None


def load_gaia(path: str | Path) -> list[BenchmarkRecord]:
    """GAIA records (`metadata["level"]` an int, `metadata["annotator_metadata"]` a dict or None)."""
    metadata_file = _gaia_metadata_file(Path(path))
    if metadata_file.suffix == ".jsonl":
        rows = _read_jsonl(metadata_file)
    elif metadata_file.suffix == ".parquet":
        rows = _read_parquet(metadata_file)
    else:
        raise BenchmarkFormatError(metadata_file, "file", "expected a .jsonl or .parquet metadata file")
    records = []
    for location, row in rows:
        if not isinstance(row, dict):
            raise BenchmarkFormatError(metadata_file, location, "a record must be a JSON object")
        task_id = _require_string(metadata_file, location, row, "task_id")
        question = _require_string(metadata_file, location, row, "Question")
        answer = _require_string(metadata_file, location, row, "Final answer")
        file_name = row.get("file_name") or ""
        file_path = row.get("file_path") or ""
        if not isinstance(file_name, str) or not isinstance(file_path, str):
            raise BenchmarkFormatError(metadata_file, location, "file_name and file_path must be strings")
        annotator = row.get("Annotator Metadata")
        if annotator is not None and not isinstance(annotator, dict):
            raise BenchmarkFormatError(metadata_file, location, "'Annotator Metadata' must be an object")
        records.append(BenchmarkRecord(
            id=task_id,
            question=question,
            answer=None if answer.strip() == GAIA_UNLABELLED else answer,
            benchmark=GAIA,
            metadata={
                "level": _gaia_level(metadata_file, location, row.get("Level")),
                "file_name": file_name,
                "annotator_metadata": annotator,
            },
            attachment=_gaia_attachment(metadata_file.parent, file_name, file_path),
        ))
    return _some(metadata_file, records)


def gaia_text_only(records: Iterable[BenchmarkRecord]) -> list[BenchmarkRecord]:
    """The records without an attachment (the "GAIA-text-103" subset of the validation split)."""
    return [record for record in records if not record.metadata.get("file_name")]


# ---------------------------------------------------------------- XBench-DeepSearch


def _xor(data: bytes, key: bytes) -> bytes:
    return bytes(byte ^ key[index % len(key)] for index, byte in enumerate(data))


def xbench_decrypt(field_text: str, canary: str) -> str:
    """XBench's `xor_decrypt`: base64-decode, XOR with the repeating UTF-8 canary, decode UTF-8."""
    data = base64.b64decode(field_text, validate=True)
    return _xor(data, canary.encode("utf-8")).decode("utf-8")


def xbench_encrypt(plain_text: str, canary: str) -> str:
    """The inverse of `xbench_decrypt` (for writing test fixtures)."""
    return base64.b64encode(_xor(plain_text.encode("utf-8"), canary.encode("utf-8"))).decode("ascii")


def load_xbench(path: str | Path) -> list[BenchmarkRecord]:
    """XBench-DeepSearch records; `metadata` holds the decrypted `reference_steps` (never show it to the
    agent) and the `canary`."""
    path = Path(path)
    text = _decode(path, _read_bytes(path), "utf-8-sig")
    if not text.strip():
        raise BenchmarkFormatError(path, "file", "no records (an empty file)")
    records = []
    with io.StringIO(text, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [column for column in XBENCH_COLUMNS if column not in (reader.fieldnames or ())]
        if missing:
            raise BenchmarkFormatError(path, "header", f"missing column(s) {', '.join(missing)}")
        try:
            for row_number, row in enumerate(reader, start=1):
                location = f"row {row_number} (line {reader.line_num})"
                if None in row or any(row[column] is None for column in XBENCH_COLUMNS):
                    raise BenchmarkFormatError(path, location, "wrong number of fields")
                canary = row["canary"]
                if not canary:
                    raise BenchmarkFormatError(path, location, "empty canary (it is the decryption key)")
                if not row["id"].strip().isdigit():
                    raise BenchmarkFormatError(path, location, f"id must be an integer, got {row['id']!r}")
                plain = {}
                for column in ("prompt", "answer", "reference_steps"):
                    try:
                        plain[column] = xbench_decrypt(row[column], canary)
                    except (binascii.Error, ValueError):
                        raise BenchmarkFormatError(
                            path, location, f"column {column!r} does not decrypt with this row's canary"
                        ) from None
                records.append(BenchmarkRecord(
                    id=row["id"].strip(),
                    question=plain["prompt"],
                    answer=plain["answer"],
                    benchmark=XBENCH,
                    metadata={"reference_steps": plain["reference_steps"], "canary": canary},
                ))
        except csv.Error as error:
            raise BenchmarkFormatError(path, f"line {reader.line_num}", f"malformed CSV ({error})") from None
    return _some(path, records, "a header and no rows")


# ---------------------------------------------------------------- WebWalkerQA

_LANGUAGES = {"english": "en", "chinese": "zh"}
_INFO_KEYS = ("type", "difficulty_level", "domain", "lang", "source_website", "golden_path")
# Capitalised documentation variant -> real key.
_CAPITALISED_INFO = {"Hop": "type", "Difficulty_Level": "difficulty_level", "Domain": "domain",
                     "Language": "lang", "Source_Website": "source_website", "Golden_Path": "golden_path"}


def _first_present(record: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        if key in record:
            return record[key]
    return None


def _webwalker_record(path: Path, location: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise BenchmarkFormatError(path, location, "a record must be a JSON object")
    question = _first_present(raw, ("question", "Question"))
    answer = _first_present(raw, ("answer", "Answer"))
    root_url = _first_present(raw, ("root_url", "Root_Url"))
    for key, value in (("question", question), ("answer", answer), ("root_url", root_url)):
        if not isinstance(value, str):
            raise BenchmarkFormatError(path, location, f"field {key!r} missing or not a string")
    info_raw = _first_present(raw, ("info", "Info"))
    if info_raw is None:
        info_raw = {key: raw[key] for key in _INFO_KEYS if key in raw}  # the flattened variant
    if not isinstance(info_raw, dict):
        raise BenchmarkFormatError(path, location, "field 'info' must be an object")
    info = {_CAPITALISED_INFO.get(key, key): value for key, value in info_raw.items()}
    for key in ("type", "difficulty_level", "domain", "lang"):
        if key in info and not isinstance(info[key], str):
            raise BenchmarkFormatError(path, location, f"info field {key!r} must be a string")
    if "type" in info:
        info["type"] = info["type"].lower().replace("-", "_")
    for key in ("difficulty_level", "domain"):
        if key in info:
            info[key] = info[key].lower()
    if "lang" in info:
        info["lang"] = _LANGUAGES.get(info["lang"].lower(), info["lang"].lower())
    for key in ("source_website", "golden_path"):
        value = info.get(key, [])
        info[key] = [value] if isinstance(value, str) else value
        if not isinstance(info[key], list) or not all(isinstance(item, str) for item in info[key]):
            raise BenchmarkFormatError(path, location, f"info field {key!r} must be a list of strings")
    return {"question": question, "answer": answer, "root_url": root_url, "info": info}


def load_webwalker(path: str | Path) -> list[BenchmarkRecord]:
    """WebWalkerQA records; `metadata` is the normalised `info` (type single_source/multi_source,
    difficulty_level, domain, lang, source_website, golden_path). Ids are derived from the question text,
    which is how the official evaluator matches predictions to gold."""
    path = Path(path)
    data = _read_bytes(path)
    text = _decode(path, data, "utf-8-sig")
    if text.lstrip().startswith("["):
        array = _parse_json(path, text)
        rows = [(f"element {index}", raw) for index, raw in enumerate(array)]
    else:
        rows = _read_jsonl(path, data)
    records, seen_ids = [], {}
    for location, raw in rows:
        fields = _webwalker_record(path, location, raw)
        base_id = hashlib.sha1(fields["question"].encode("utf-8")).hexdigest()[:16]
        seen_ids[base_id] = seen_ids.get(base_id, 0) + 1
        record_id = base_id if seen_ids[base_id] == 1 else f"{base_id}-{seen_ids[base_id]}"
        records.append(BenchmarkRecord(
            id=record_id,
            question=fields["question"],
            answer=fields["answer"],
            benchmark=WEBWALKER,
            metadata=fields["info"],
            root_url=fields["root_url"],
        ))
    return _some(path, records)


LOADERS = {GAIA: load_gaia, XBENCH: load_xbench, WEBWALKER: load_webwalker}


def load_benchmark(benchmark: str, path: str | Path) -> list[BenchmarkRecord]:
    """The records of `benchmark` (gaia, xbench or webwalker) at `path`, by that benchmark's loader."""
    if benchmark not in LOADERS:
        raise ValueError(f"unknown benchmark {benchmark!r}: expected one of {', '.join(LOADERS)}")
    return LOADERS[benchmark](path)
