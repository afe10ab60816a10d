"""JSONL sources and the refusals of bad data.sources input, each naming the field or file:line."""
from __future__ import annotations

import gzip
import json

import pytest

from sftjob_contract.config import ConfigError, build_config
from sftjob_trainer import jsonl
from tools.assets import write_parquet
from sftjob_trainer.errors import InvalidData
from sftjob_trainer.jsonl import JsonlRows, open_rows

pytestmark = pytest.mark.unit


def rows_of(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(n)]


def test_rows_across_groups_blank_lines_and_a_last_line_without_newline(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "LINES_PER_GROUP", 3)
    monkeypatch.setattr(jsonl, "READ_BLOCK", 16)   # lines straddle the read blocks
    lines = [json.dumps(r) for r in rows_of(8)]
    body = "\n".join(lines[:4]) + "\n\n  \n" + "\n".join(lines[4:])   # two blank lines, no final newline
    (tmp_path / "a.jsonl").write_text(body)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[:2]) + "\n").encode()))
    rows = JsonlRows([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")], ["prompt", "response"])
    assert rows.num_rows == 10
    assert [rows.row(i)["prompt"] for i in (9, 0, 5, 4, 7, 8)] == ["p1", "p0", "p5", "p4", "p7", "p0"]
    assert len(rows.groups) == 4          # 3 + 3 + 2 rows of a.jsonl, 2 of b.jsonl.gz
    assert rows.fingerprint() != JsonlRows([str(tmp_path / "a.jsonl")], ["prompt"]).fingerprint()


@pytest.mark.parametrize("bad,why", [("{\"prompt\": \"p\", ", "not valid JSON"),
                                     ("[1, 2]", "a JSONL line must be a JSON object, got list"),
                                     ("{\"prompt\": \"p\"}", "missing key\\(s\\) response")])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad, why):
    lines = [json.dumps(r) for r in rows_of(3)]
    lines.insert(2, "")          # a blank line 3: the bad one is line 5
    lines.insert(4, bad)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = JsonlRows([str(path)], ["prompt", "response"], ["spec.data.sources[1].files[0]"])
    assert rows.row(2)["prompt"] == "p2"
    with pytest.raises(InvalidData, match=rf"spec.data.sources\[1\].files\[0\] {path}:5: {why}"):
        rows.row(3)


def test_the_format_comes_from_the_names_or_the_setting(tmp_path):
    write_parquet(rows_of(2), tmp_path / "d" / "x.parquet")
    (tmp_path / "d" / "y.jsonl").write_text(json.dumps(rows_of(1)[0]) + "\n")
    (tmp_path / "z.txt").write_text(json.dumps(rows_of(1)[0]) + "\n")
    cols, field = ["prompt", "response"], "spec.data.sources[0].files"
    with pytest.raises(InvalidData, match=r"mix parquet and JSONL; set spec.data.sources\[0\].format"):
        open_rows([str(tmp_path / "d")], cols, field, None, "spec.data.sources[0].format")
    with pytest.raises(InvalidData, match=r"cannot tell the format of .*z.txt.*set spec.data.sources\[0\].format"):
        open_rows([str(tmp_path / "z.txt")], cols, field, None, "spec.data.sources[0].format")
    fmt, rows = open_rows([str(tmp_path / "d")], cols, field, "jsonl")   # a directory: this format's files
    assert (fmt, rows.num_rows) == ("jsonl", 1)
    fmt, rows = open_rows([str(tmp_path / "z.txt")], cols, field, "jsonl")
    assert (fmt, rows.num_rows) == ("jsonl", 1)
    fmt, rows = open_rows([str(tmp_path / "d")], cols, field)             # train_files: parquet, as always
    assert (fmt, rows.num_rows) == ("parquet", 2)


BASE = {"model": {"path": "/m"}, "trainer": {"output_dir": "/o", "total_epochs": 1}}


@pytest.mark.parametrize("data,message", [
    ({"train_files": ["/a.parquet"], "sources": [{"files": ["/b.jsonl"]}]},
     "give exactly one of data.train_files .* and data.sources .*; both are set"),
    ({}, "give exactly one of data.train_files .* and data.sources .*; neither is set"),
    ({"sources": [{"files": ["/b.jsonl"], "weight": 0}]}, r"data.sources.0.weight: Input should be greater than 0"),
    ({"sources": [{"files": ["/b.jsonl"], "weight": -1}]}, r"data.sources.0.weight: Input should be greater than 0"),
    ({"sources": [{"files": ["/b.csv"], "format": "csv"}]},
     r"data.sources.0.format: Input should be 'parquet' or 'jsonl'"),
    ({"sources": [{"files": ["/b"], "name": "x"}, {"files": ["/c"], "name": "x"}]}, r"data.sources\[0\].name 'x'"),
    ({"sources": [{"files": ["/b"], "name": "a b"}]}, r"data.sources.0.name: String should match pattern"),
    ({"sources": [{"files": ["/b"], "prompt_key": "response"}]}, r"data.sources\[0\]: prompt_key and response_key"),
    ({"sources": []}, r"data.sources: List should have at least 1 item"),
])
def test_bad_sources_are_refused_naming_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        build_config({**BASE, "data": data})


def test_old_and_new_forms_are_accepted():
    old = build_config({**BASE, "data": {"train_files": "/a.parquet"}}).data
    assert old.train_files == ["/a.parquet"] and old.sources is None
    new = build_config({**BASE, "data": {"messages_key": "m", "sources": [
        {"files": "/a.parquet", "weight": 3}, {"files": ["/b.jsonl"], "prompt_key": "q", "response_key": "a"}]}}).data
    assert new.source_names() == ["0", "1"] and new.sources[0].files == ["/a.parquet"]
    assert new.sources[0].columns(new) == ("prompt", "response", "m")     # inherits all three
    assert new.sources[1].columns(new) == ("q", "a", None)                # its own: single-turn
