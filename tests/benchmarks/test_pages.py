"""The figures pages: RESULTS.md's table and README's Figures table are what ``benchmarks/pages.py`` writes from
the newest record of each benchmark; every committed record follows the schema; the generator on a tiny fake
record set; a benchmark's record is picked up as the newest."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import pages
from benchmarks.compare import figures as comparison_figures
from benchmarks.compare import record
from benchmarks.lib.record import RECORDS, RECORDS_ENV, SCHEMA, record_path, write_record

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"schema", "benchmark", "command", "commit", "dirty", "date", "started", "machine", "args", "figures",
          "samples"}


def _block(text: str) -> tuple[str, str]:
    """(the generated table, the page without it)."""
    start, end = text.index(pages.BEGIN), text.index(pages.END)
    return text[start:end], text[:start] + text[end:]


@pytest.mark.parametrize("page", list(pages.PAGES), ids=lambda p: p.name)
def test_the_page_is_what_the_generator_writes(page: Path) -> None:
    text = page.read_text()
    assert pages.render(page, text, pages.newest_records()) == text, \
        f"{page.name} differs from the records: run .venv/bin/python -m benchmarks.pages"


def test_results_is_short_and_quotes_no_result_line_outside_its_table() -> None:
    text = pages.RESULTS_PAGE.read_text()
    assert len(text.splitlines()) < 300
    _, rest = _block(text)
    assert re.findall(r"\b\w+=\d", rest) == []  # a `name=value` line outside the table would be a stale figure


def test_readmes_figures_section_quotes_no_figure_outside_its_table() -> None:
    text = pages.README.read_text()
    section = text[text.index("\n## Figures\n"):]
    section = section[: section.index("\n## ", 5)]
    _, rest = _block(section)
    assert re.findall(r"\d\.\d", rest) == []


@pytest.mark.parametrize("path", sorted(RECORDS.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_record_follows_the_schema(path: Path) -> None:
    rec = json.loads(path.read_text())
    assert FIELDS <= set(rec) and rec["schema"] == SCHEMA
    assert path.name.startswith(rec["benchmark"] + "_")
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", rec["commit"]) and rec["dirty"] in (True, False, None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date"])
    assert rec["command"].startswith(".venv/bin/python ") and rec["machine"]["summary"]
    assert all(isinstance(v, (int, float, str)) or v is None for v in rec["figures"].values())
    if rec["dirty"] is None:  # not recorded by the run: the record says where its commit comes from
        assert rec.get("commit_source")


def test_every_row_of_a_recorded_benchmark_finds_its_figures() -> None:
    records = pages.newest_records()
    missing = [(row.benchmark, row.figure) for row in pages.ROWS if row.benchmark in records
               and (pages.fill(row.value, records[row.benchmark]["figures"]) is None
                    or pages.fill(row.means, records[row.benchmark]["figures"]) is None)]
    assert missing == []
    assert {row.benchmark for row in pages.ROWS} <= set(pages.SECTIONS)


# ------------------------------------------------------------------------------------------------ fake records
def _fake(folder: Path, name: str, date: str, figures: dict, dirty: bool | None = False) -> Path:
    rec = {"schema": SCHEMA, "benchmark": name, "command": f".venv/bin/python benchmarks/{name}.py --x 1",
           "commit": "a" * 40, "dirty": dirty, "date": date, "started": None,
           "machine": {"summary": "2 cores (CPU), 8 GiB, no GPU", "cores": 2, "gpus": []}, "args": {},
           "figures": figures, "samples": {}}
    path = folder / f"{name}_{date.replace(':', '').replace('-', '')}.json"
    path.write_text(json.dumps(rec))
    return path


def test_the_newest_record_of_each_benchmark_is_taken(tmp_path: Path) -> None:
    _fake(tmp_path, "overhead", "2026-12-04T10:00:00Z", {"overhead": 1.2})
    _fake(tmp_path, "overhead", "2026-12-05T10:00:00Z", {"overhead": 0.9})
    _fake(tmp_path, "overhead", "2026-12-03T10:00:00Z", {"overhead": 1.5})
    _fake(tmp_path, "straggler", "2026-12-01T10:00:00Z", {"max_dloss": 2e-7})
    newest = pages.newest_records(tmp_path)
    assert newest["overhead"]["figures"] == {"overhead": 0.9} and set(newest) == {"overhead", "straggler"}


def test_a_row_is_left_out_where_its_record_lacks_a_figure_and_none_reads_na(tmp_path: Path) -> None:
    _fake(tmp_path, "overhead", "2026-12-05T10:00:00Z", {"overhead": 0.9, "recover_median_step_ms": 450.0,
                                                         "stock_median_step_ms": 470.0, "overhead_mean": None,
                                                         "overhead_pairwise": 0.95})
    table = pages.results_table(pages.newest_records(tmp_path))
    rows = table.splitlines()[2:]
    assert len(rows) == 2  # the overhead rows; the breakdown, headline, ... have no record
    assert "**0.900** (450 vs 470 ms)" in rows[0] and "n/a / 0.950" in rows[1]
    assert "`.venv/bin/python benchmarks/overhead.py --x 1` | aaaaaaa | 2 cores (CPU), 8 GiB, no GPU | 2026-12-05 |" \
        in rows[0]
    readme = pages.readme_table(pages.newest_records(tmp_path)).splitlines()
    assert len(readme) == 3 and "`benchmarks/overhead.py`, aaaaaaa, 2026-12-05, 2 cores, no GPU" in readme[2]
    assert pages.fill("{x:.2f} {y}", {"x": float("nan"), "y": 1}) == "n/a 1"
    assert pages.fill("{missing}", {}) is None


def test_commit_labels() -> None:
    assert pages.commit_label({"commit": "b" * 40, "dirty": False}) == "bbbbbbb"
    assert pages.commit_label({"commit": "b" * 40, "dirty": True}) == "bbbbbbb+"
    assert pages.commit_label({"commit": "b" * 40, "dirty": None}) == "≈bbbbbbb"
    assert pages.commit_label({"commit": "unknown", "dirty": None}) == "unknown"


def test_the_block_is_replaced_only_between_its_markers_and_inside_its_section() -> None:
    page = f"# T\n\n## Figures\n\n{pages.BEGIN}\nold\n{pages.END}\n\nkept\n\n## Next\n"
    assert pages.replace_block(page, "new", "Figures") == page.replace("\nold\n", "\nnew\n")
    with pytest.raises(ValueError):
        pages.replace_block(page, "new", "Next")
    with pytest.raises(ValueError):
        pages.replace_block("no markers", "new")


def test_check_fails_on_a_stale_page_and_passes_once_written(tmp_path: Path, monkeypatch, capsys) -> None:
    records = tmp_path / "records"
    records.mkdir()
    _fake(records, "overhead", "2026-12-05T10:00:00Z", {"overhead": 0.9, "recover_median_step_ms": 450.0,
                                                        "stock_median_step_ms": 470.0})
    results, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    results.write_text(f"# R\n{pages.BEGIN}\n{pages.END}\n")
    readme.write_text(f"# X\n\n## Figures\n\n{pages.BEGIN}\n{pages.END}\n\n## Next\n")
    monkeypatch.setattr(pages, "PAGES", {results: (pages.results_table, None), readme: (pages.readme_table, "Figures")})
    assert pages.main(["--check", "--records", str(records)]) == 1
    assert "+| [overhead](#failure-free-overhead)" in capsys.readouterr().out
    assert pages.main(["--records", str(records)]) == 0
    assert pages.main(["--check", "--records", str(records)]) == 0
    assert "ReCoVer / stock 0.900" in readme.read_text()


# ------------------------------------------------------------------------------------------------ records
def test_a_record_from_python_is_written_only_where_the_variable_names_a_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(RECORDS_ENV)
    kw = dict(command=".venv/bin/python benchmarks/x.py", args={"a": 1}, samples=[1.0], figures={"f": 2.0})
    assert write_record("x", argv=["--a", "1"], **kw) is None
    monkeypatch.setenv(RECORDS_ENV, str(tmp_path))
    path = write_record("x", argv=["--a", "1"], **kw)
    rec = json.loads(path.read_text())
    assert path.parent == tmp_path and FIELDS <= set(rec) and rec["figures"] == {"f": 2.0}
    assert re.fullmatch(r"[0-9a-f]{40}", rec["commit"]) and isinstance(rec["dirty"], bool)
    m = rec["machine"]
    assert m["cores"] >= 1 and m["summary"] and "load_avg_1min_at_start" in m and "python" in m
    assert record_path(tmp_path, "x", 0.0).name == "x_19700101T000000Z.json"
    (tmp_path / "x_19700101T000000Z.json").write_text("{}")
    assert record_path(tmp_path, "x", 0.0).name == "x_19700101T000000Z-2.json"


def test_a_quick_run_from_the_command_line_lands_among_the_measurements_only_where_asked(tmp_path, monkeypatch,
                                                                                         capsys) -> None:
    """A smoke-test-sized run measures nothing the pages should take as newest (it would replace a real record)."""
    import argparse

    from benchmarks.lib import record as record_module

    monkeypatch.delenv(RECORDS_ENV)
    monkeypatch.setattr(record_module, "RECORDS", tmp_path / "measurements")  # where a broken guard would write
    kw = dict(command=".venv/bin/python benchmarks/x.py --quick", samples=[1.0], figures={"f": 2.0})
    assert write_record("x", argv=None, args=argparse.Namespace(quick=True), **kw) is None
    assert not (tmp_path / "measurements").exists()
    assert "no record: a --quick run" in capsys.readouterr().err
    monkeypatch.setenv(RECORDS_ENV, str(tmp_path))
    path = write_record("x", argv=None, args=argparse.Namespace(quick=True), **kw)
    assert path is not None and path.parent == tmp_path


def test_a_new_headline_run_writes_the_record_the_pages_take_as_newest(tmp_path, records_folder) -> None:
    for path in RECORDS.glob("*.json"):
        shutil.copy(path, records_folder)
    raw = ROOT / "benchmarks" / "results" / "headline.json"
    shutil.copy(raw, tmp_path / "headline.json")
    record("headline", tmp_path, "headline.json", ["--out", str(tmp_path)],
           f".venv/bin/python benchmarks/headline.py --out {tmp_path}", {"out": str(tmp_path)})
    newest = pages.newest_records(records_folder)["headline"]
    assert newest["command"].endswith(str(tmp_path)) and newest["samples"]["runs"]["recover"]["final_step"] == 48
    assert newest["figures"] == json.loads(json.dumps(comparison_figures(json.loads(raw.read_text()))))
    table = pages.results_table(pages.newest_records(records_folder))
    assert f"benchmarks/headline.py --out {tmp_path}` | {newest['commit'][:7]}" in table


def test_a_script_run_writes_its_record(records_folder) -> None:
    from benchmarks.snapshot_write_bench import main

    ms = main(["--mb", "1", "--writes", "4", "--dir", str(records_folder.parent)])
    (path,) = records_folder.glob("snapshot_write_*.json")
    rec = json.loads(path.read_text())
    assert rec["figures"]["snapshot_write_ms"] == ms and len(rec["samples"]["write_s"]) == 4
    assert rec["command"] == ".venv/bin/python benchmarks/snapshot_write_bench.py --mb 1 --writes 4 --dir " \
        + str(records_folder.parent)
    assert rec["args"]["mb"] == 1
