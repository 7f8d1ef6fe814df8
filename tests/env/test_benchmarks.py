import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mgrpo_jax.env.benchmarks import (
    LOADERS,
    BenchmarkFormatError,
    gaia_text_only,
    load_benchmark,
    load_gaia,
    load_webwalker,
    load_xbench,
    xbench_decrypt,
    xbench_encrypt,
)

# Invented records in the real schemas; no benchmark text is stored in the repository.
_ANNOTATOR = {"Steps": "1. look", "Number of steps": "1", "How long did this take?": "1 minute",
              "Tools": "none", "Number of tools": "0"}


def _gaia_rows(level_type):
    return [
        {"task_id": "aaaa-1", "Question": "How many moons does the planet Zorb have?", "Level": level_type(1),
         "Final answer": "17", "file_name": "", "Annotator Metadata": _ANNOTATOR},
        {"task_id": "bbbb-2", "Question": "What colour is the cell B2 in the attached sheet?", "Level": level_type(2),
         "Final answer": "?", "file_name": "bbbb-2.xlsx", "Annotator Metadata": _ANNOTATOR},
    ]


def test_gaia_jsonl_layout(tmp_path):
    split = tmp_path / "2023" / "validation"
    split.mkdir(parents=True)
    (split / "metadata.jsonl").write_text("\n".join(json.dumps(row) for row in _gaia_rows(int)) + "\n\n")
    (split / "bbbb-2.xlsx").write_bytes(b"sheet")
    records = load_gaia(split)
    assert [r.id for r in records] == ["aaaa-1", "bbbb-2"]
    first, second = records
    assert first.answer == "17" and first.metadata["level"] == 1 and first.attachment is None
    assert second.answer is None  # the test split's placeholder
    assert second.attachment == split / "bbbb-2.xlsx" and second.attachment.exists()
    assert first.metadata["annotator_metadata"]["Number of steps"] == "1"
    assert gaia_text_only(records) == [first]
    assert load_gaia(split / "metadata.jsonl") == records


def test_gaia_parquet_layout_with_file_path(tmp_path):
    split = tmp_path / "2023" / "test"
    split.mkdir(parents=True)
    rows = _gaia_rows(str)
    for row in rows:
        row["file_path"] = f"2023/test/{row['file_name']}" if row["file_name"] else ""
    rows[0].pop("Annotator Metadata")  # withheld on the test split
    rows[1]["Annotator Metadata"] = None
    pq.write_table(pa.Table.from_pylist(rows), split / "metadata.parquet")
    (split / "bbbb-2.xlsx").write_bytes(b"sheet")
    records = load_gaia(split)
    assert [r.metadata["level"] for r in records] == [1, 2]
    assert records[0].metadata["annotator_metadata"] is None
    assert records[1].attachment == tmp_path / "2023/test/bbbb-2.xlsx"
    pq.write_table(pa.Table.from_pylist(rows[:1]), split / "metadata.level1.parquet")
    assert len(load_gaia(split / "metadata.level1.parquet")) == 1


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda rows: rows[1].update(Level=7), "line 2: field 'Level' must be 1, 2 or 3"),
        (lambda rows: rows[1].pop("Question"), "line 2: field 'Question' missing"),
        (lambda rows: rows[0].update({"Final answer": 17}), "line 1: field 'Final answer' must be a string"),
    ],
)
def test_gaia_errors_name_file_line_and_problem(tmp_path, mutate, message):
    rows = _gaia_rows(int)
    mutate(rows)
    path = tmp_path / "metadata.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(BenchmarkFormatError, match=message) as error:
        load_gaia(path)
    assert str(path) in str(error.value)


def test_gaia_bad_json_and_missing_metadata(tmp_path):
    path = tmp_path / "metadata.jsonl"
    path.write_text(json.dumps(_gaia_rows(int)[0]) + "\n{broken\n")
    with pytest.raises(BenchmarkFormatError, match="line 2: invalid JSON"):
        load_gaia(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BenchmarkFormatError, match="neither metadata.jsonl nor metadata.parquet"):
        load_gaia(empty)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(BenchmarkFormatError, match="not a readable Parquet"):
        load_gaia(tmp_path / "bad.parquet")


CANARY = "BENCHMARK DATA SHOULD NEVER APPEAR AS PLAIN TEXT ONLINE. canary GUID xbench-DeepSearch:test-guid"


def test_xbench_encryption_round_trip():
    for text in ("", "1987", "一个虚构的问题？", "x" * 500):
        assert xbench_decrypt(xbench_encrypt(text, CANARY), CANARY) == text


def _xbench_csv(path, rows, bom=True):
    lines = ["id,prompt,answer,reference_steps,canary"]
    for row_id, prompt, answer, steps in rows:
        fields = [str(row_id)] + [xbench_encrypt(value, CANARY) for value in (prompt, answer, steps)] + [CANARY]
        lines.append(",".join(f'"{field}"' for field in fields))
    path.write_text(("\ufeff" if bom else "") + "\n".join(lines) + "\n", encoding="utf-8")


def test_xbench_csv_with_bom_and_per_row_decryption(tmp_path):
    path = tmp_path / "DeepSearch.csv"
    _xbench_csv(path, [(1, "虚构城市的人口是多少？", "48210", "1. 搜索"), (2, "Invented question?", "1987", "1. x")])
    records = load_xbench(path)
    assert [(r.id, r.question, r.answer) for r in records] == [
        ("1", "虚构城市的人口是多少？", "48210"), ("2", "Invented question?", "1987")]
    assert records[0].metadata["reference_steps"] == "1. 搜索" and records[0].benchmark == "xbench"


def test_xbench_errors(tmp_path):
    path = tmp_path / "DeepSearch.csv"
    _xbench_csv(path, [(1, "q", "a", "s")])
    text = path.read_text(encoding="utf-8-sig")
    (tmp_path / "header.csv").write_text(text.replace("canary", "key"))
    with pytest.raises(BenchmarkFormatError, match="header: missing column"):
        load_xbench(tmp_path / "header.csv")
    (tmp_path / "row.csv").write_text(text + '"2","!!!notbase64","x","y","k"\n')
    with pytest.raises(BenchmarkFormatError, match=r"row 2 \(line 3\): column 'prompt' does not decrypt"):
        load_xbench(tmp_path / "row.csv")
    (tmp_path / "short.csv").write_text(text + '"3","abc"\n')
    with pytest.raises(BenchmarkFormatError, match="row 2.*wrong number of fields"):
        load_xbench(tmp_path / "short.csv")
    with pytest.raises(BenchmarkFormatError, match="cannot open"):
        load_xbench(tmp_path / "missing.csv")


_WW_LOWER = {"question": "Where is the invented conference held?", "answer": "It is held in Zorbtown.",
             "root_url": "https://conf.example.org",
             "info": {"type": "single_source", "difficulty_level": "easy", "domain": "conference", "lang": "en",
                      "source_website": ["https://conf.example.org/venue"], "golden_path": ["root->Venue"]}}
_WW_CAPITAL = {"Question": "Who chairs the invented society?", "Answer": "A. Person",
               "Root_Url": "https://soc.example.org",
               "Info": {"Hop": "multi-source", "Difficulty_Level": "Medium", "Domain": "Organization",
                        "Language": "English", "Source_Website": "https://soc.example.org/board",
                        "Golden_Path": ["root->About->Board"]}}
_WW_FLAT = {"Question": "Which invented game won?", "answer": "Game X", "root_url": "https://game.example.org",
            "type": "multi_source", "difficulty_level": "hard", "domain": "game", "lang": "zh",
            "source_website": ["a", "b"], "golden_path": ["root->A", "root->B"]}


def test_webwalker_variants(tmp_path):
    jsonl = tmp_path / "main-00000-of-00001.jsonl"
    jsonl.write_text(json.dumps(_WW_LOWER) + "\n" + json.dumps(_WW_CAPITAL) + "\n")
    lower, capital = load_webwalker(jsonl)
    assert lower.root_url == "https://conf.example.org" and lower.metadata["type"] == "single_source"
    assert capital.metadata == {"type": "multi_source", "difficulty_level": "medium", "domain": "organization",
                                "lang": "en", "source_website": ["https://soc.example.org/board"],
                                "golden_path": ["root->About->Board"]}
    assert lower.id != capital.id and len(lower.id) == 16
    flat = tmp_path / "test.json"
    flat.write_text(json.dumps([_WW_FLAT, _WW_FLAT]))
    first, second = load_webwalker(flat)
    assert first.question == "Which invented game won?" and first.metadata["lang"] == "zh"
    assert second.id == first.id + "-2"


def test_webwalker_errors(tmp_path):
    path = tmp_path / "main.jsonl"
    broken = dict(_WW_LOWER, info=dict(_WW_LOWER["info"], source_website=[1]))
    path.write_text(json.dumps(_WW_LOWER) + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(BenchmarkFormatError, match="line 2: info field 'source_website'"):
        load_webwalker(path)
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(BenchmarkFormatError, match="line 1: field 'answer' missing"):
        load_webwalker(path)
    path.write_text("[1, 2]")
    with pytest.raises(BenchmarkFormatError, match="element 0: a record must be a JSON object"):
        load_webwalker(path)


# ---------------------------------------------------------------- files that are not benchmark files at all

_HEADER = b"id,prompt,answer,reference_steps,canary\n"
_DEEP = b"[" * 50000 + b"]" * 50000


@pytest.mark.parametrize(
    ("loader", "name", "data", "message"),
    [
        (load_gaia, "metadata.jsonl", b"", "file: no records"),
        (load_gaia, "metadata.jsonl", b"\n  \n", "file: no records"),
        (load_xbench, "DeepSearch.csv", b"", "file: no records"),
        (load_xbench, "DeepSearch.csv", b"\xef\xbb\xbf" + _HEADER, r"file: no records \(a header and no rows\)"),
        (load_webwalker, "main.jsonl", b"", "file: no records"),
        (load_webwalker, "test.json", b"[]", "file: no records"),
        (load_gaia, "metadata.jsonl", json.dumps(_gaia_rows(int)[0]).encode() + b"\n\x89PNG\r\n\x1a\n\x00\xff",
         r"line 2: not UTF-8 text \(byte 0x89 at column 1"),
        (load_xbench, "DeepSearch.csv", _HEADER + b'"1","a\xffb","c","d","e"\n',
         r"line 2: not UTF-8 text \(byte 0xff at column 7"),
        (load_webwalker, "main.jsonl", bytes(range(1, 256)), r"line 3: not UTF-8 text \(byte 0x80 at column 115"),
        (load_webwalker, "main.jsonl", b"{}\r\n{\x00}", r"line 2: not text \(a NUL byte at column 2"),
        (load_xbench, "DeepSearch.csv", _HEADER + b'"1","\x00","c","d","e"\n', "line 2: not text"),
        (load_webwalker, "test.json", b"[\n" + json.dumps(_WW_LOWER).encode() + b",\n\xc3(]", "line 3: not UTF-8"),
        (load_gaia, "metadata.jsonl", json.dumps(_gaia_rows(int)[0]).encode() + b"\n" + _DEEP,
         "line 2: JSON nested too deeply"),
        (load_webwalker, "main.jsonl", _DEEP, "line 1: JSON nested too deeply"),
        (load_webwalker, "test.json", b"[\n" + json.dumps(_WW_LOWER).encode() + b",\n" + b'{"a":' * 20000
         + b"1" + b"}" * 20000 + b"]", "line 3: JSON nested too deeply"),
    ],
)
def test_empty_binary_and_deeply_nested_files_are_refused_with_file_and_line(tmp_path, loader, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(BenchmarkFormatError, match=message) as error:
        loader(path)
    assert str(error.value).startswith(f"{path}: ")
    assert isinstance(error.value, ValueError)


def test_a_utf8_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "main.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_WW_LOWER).encode() + b"\r\n")
    assert load_webwalker(path)[0].question == _WW_LOWER["question"]
    gaia = tmp_path / "metadata.jsonl"
    gaia.write_bytes(b"\xef\xbb\xbf" + json.dumps(_gaia_rows(int)[0]).encode())
    assert load_gaia(gaia)[0].id == "aaaa-1"


def test_load_benchmark_by_name(tmp_path):
    path = tmp_path / "main.jsonl"
    path.write_text(json.dumps(_WW_LOWER) + "\n")
    assert set(LOADERS) == {"gaia", "xbench", "webwalker"}
    assert load_benchmark("webwalker", path) == load_webwalker(path)
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        load_benchmark("mmlu", path)
