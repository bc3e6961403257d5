"""The launcher's output filter: Open MPI's repair noise is counted, everything else passes unchanged."""

from __future__ import annotations

from nanotron_recover.run.output_filter import NoiseFilter, noise_summary

NOISE = b"[host:01234] NBC_Progress: an error 75 was found during schedule 0x55d0 - aborting the schedule\n"


def test_noise_is_dropped_and_counted_even_across_chunk_boundaries() -> None:
    f = NoiseFilter()
    stream = b"[step 1] loss 4.1\n" + NOISE + NOISE + b"[step 2] loss 4.0\npartial"
    out = b"".join(f.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + f.flush()
    assert out == b"[step 1] loss 4.1\n[step 2] loss 4.0\npartial"
    assert f.dropped == 2
    summary = noise_summary(f.dropped)
    assert summary is not None and "2 line(s)" in summary
    assert noise_summary(0) is None


def test_a_line_that_never_ends_is_not_held_back_for_ever() -> None:
    f = NoiseFilter()
    assert f.feed(b"x" * 70000) == b"x" * 70000
