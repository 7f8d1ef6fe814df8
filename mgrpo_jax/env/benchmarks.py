"""Loaders for the real benchmarks' on-disk formats, as their publishers ship them (each described below).

- `load_gaia(path)`: a split folder or a metadata file, `metadata.jsonl` (older layout, `Level` an
  integer) or `metadata.parquet` / `metadata.levelN.parquet` (current layout, `Level` a string, extra
  `file_path`). Attachments resolve from `file_name` (beside the metadata) or `file_path` (from the
  repository root). Test-split answers `"?"` load as `answer=None`.
- `load_xbench(path)`: the DeepSearch CSV (`utf-8-sig`), each encrypted field decrypted with its own
  row's canary (repeating-key XOR over base64).
- `load_webwalker(path)`: the JSONL with the real lower-case schema; also the capitalised
  documentation variant and the flattened JSON-array variant.

A malformed file raises `BenchmarkFormatError` naming the file, the line or row, and the problem; a
loader either returns every record or raises, never a partial list. Decrypted XBench text is never put in
an error message (the maintainers ask that it not be published).
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GAIA, XBENCH, WEBWALKER = "gaia", "xbench", "webwalker"
GAIA_UNLABELLED = "?"
XBENCH_COLUMNS = ("id", "prompt", "answer", "reference_steps", "canary")


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


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {line_number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise BenchmarkFormatError(path, f"line {line_number}", f"invalid JSON ({error.msg})") from None
    return rows


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
    return records


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
    try:
        handle = path.open(encoding="utf-8-sig", newline="")
    except OSError as error:
        raise BenchmarkFormatError(path, "file", f"cannot open ({error.strerror})") from None
    records = []
    with handle:
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
    return records


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
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BenchmarkFormatError(path, "file", f"cannot read ({error})") from None
    if text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as error:
            raise BenchmarkFormatError(path, f"line {error.lineno}", f"invalid JSON ({error.msg})") from None
        rows = [(f"element {index}", raw) for index, raw in enumerate(array)]
    else:
        rows = _read_jsonl(path)
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
    return records
