"""benchmarks/scale.py at a tiny horizon: the table, the plot and the last line's format."""

import re

from benchmarks.scale import main


def test_scale_last_line_and_outputs(tmp_path, capsys):
    line = main(["--sizes", "1024", "--days", "1", "--seeds", "1", "--out", str(tmp_path)])
    m = re.fullmatch(r"ettr_100k_recover=(\S+) ettr_100k_ckpt_restart=(\S+) ettr_100k_best=(\S+) best_policy=(\w+)",
                     line)
    assert m, line
    rec, ckpt, best = map(float, m.groups()[:3])
    assert 0 < ckpt <= 1 and 0 < rec <= 1 and best >= max(rec, ckpt) - 1e-9
    assert m[4] in ("ckpt_restart", "shrinking", "recover", "recover_spares", "recover_recycle")  # never hypothetical
    assert capsys.readouterr().out.strip().splitlines()[-1] == line
    md = (tmp_path / "scale.md").read_text()
    assert "| 1024 |" in md and "| 100000 |" in md and "recover_recycle ETTR" in md
    assert (tmp_path / "scale.json").is_file()
