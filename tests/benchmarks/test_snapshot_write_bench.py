"""benchmarks/snapshot_write_bench.py at a tiny size: it writes real snapshot files and reports a positive time."""

from benchmarks.snapshot_write_bench import main


def test_the_write_benchmark_reports_a_time_and_leaves_no_files(tmp_path, capsys) -> None:
    ms = main(["--mb", "1", "--writes", "4", "--dir", str(tmp_path)])
    assert ms > 0
    assert capsys.readouterr().out.strip().endswith(f"snapshot_write_ms={ms:.1f}")
    assert list(tmp_path.iterdir()) == []  # its folder is removed
