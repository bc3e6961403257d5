"""(step, index) -> samples: a seeded per-epoch bijection, the same in every process, free to resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.data import (
    DatatroveTokenDataset,
    SyntheticTokenDataset,
    TokenDataset,
    build_dataset,
    stream_permutation,
)


def _write_ds(folder: Path, sizes: list[int], token_size: int = 2, vocab: int = 1000,
              with_manifest: bool = True) -> list[np.ndarray]:
    """Token files whose token t of file f is (f * 7919 + t) % vocab, so every window is recognisable."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = "<u2" if token_size == 2 else "<u4"
    arrays = []
    for f, n in enumerate(sizes):
        arr = ((f * 7919 + np.arange(n)) % vocab).astype(dtype)
        arr.tofile(folder / f"{f:03d}_tokens.ds")
        (folder / f"{f:03d}_tokens.ds.metadata").write_text(f"tok.json|{token_size}\n{n}\n")
        arrays.append(arr)
    if with_manifest:
        (folder / "dataset.json").write_text(json.dumps({"vocab_size": vocab, "token_size": token_size}))
    return arrays


def _epoch_ids(ds: DatatroveTokenDataset, steps: range) -> list[int]:
    return [int(i) for s in steps for m in range(ds.microbatches_per_step) for i in ds.sample_ids(s, m)]


@given(
    n=st.integers(1, 300), mbs=st.integers(1, 5), m=st.integers(1, 6),
    seed=st.integers(-(2**63), 2**63 - 1), epoch=st.integers(0, 10**6),
)
@settings(max_examples=60, deadline=None)
def test_stream_is_a_bijection_per_epoch(n: int, mbs: int, m: int, seed: int, epoch: int) -> None:
    perm = stream_permutation(n, seed, epoch)
    assert sorted(perm.tolist()) == list(range(n))
    # consecutive (step, index) pairs tile the sample stream without gaps or overlaps
    stream = SyntheticTokenDataset(50, 4, mbs, m, seed)
    positions = np.concatenate([stream.stream_positions(s, i) for s in range(3) for i in range(m)])
    assert positions.tolist() == list(range(3 * m * mbs))


def test_epochs_cover_every_sample_once(tmp_path: Path) -> None:
    _write_ds(tmp_path / "d", [5 * 11 + 3, 7 * 11, 2 * 11 + 10], vocab=1000)  # tails are dropped
    ds = DatatroveTokenDataset(tmp_path / "d", sequence_length=10, micro_batch_size=2, microbatches_per_step=3, seed=7)
    assert ds.num_samples == 14
    ids = _epoch_ids(ds, range(14))  # 14 steps * 6 samples = 6 epochs exactly
    epochs = [ids[i : i + 14] for i in range(0, len(ids), 14)]
    assert all(sorted(e) == list(range(14)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a fresh order per epoch
    unshuffled = DatatroveTokenDataset(tmp_path / "d", 10, 2, 3, seed=7, shuffle=False)
    assert _epoch_ids(unshuffled, range(7)) == list(range(14)) * 3


def test_microbatch_format_and_content(tmp_path: Path) -> None:
    arrays = _write_ds(tmp_path / "d", [40, 25], vocab=60000)
    ds = DatatroveTokenDataset(tmp_path / "d", sequence_length=4, micro_batch_size=3, microbatches_per_step=2, seed=1)
    assert isinstance(ds, TokenDataset)
    flat_windows = [a[i * 5 : (i + 1) * 5].tolist() for a in arrays for i in range(len(a) // 5)]
    assert ds.num_samples == len(flat_windows) == 13
    batch = ds.microbatch(5, 1)
    assert set(batch) == {"input_ids", "input_mask", "label_ids", "label_mask"}
    for key, dtype in (("input_ids", torch.int64), ("label_ids", torch.int64), ("input_mask", torch.bool),
                       ("label_mask", torch.bool)):
        assert batch[key].dtype == dtype and batch[key].shape == (3, 4)
    assert batch["input_mask"].all() and batch["label_mask"].all()
    for row, sid in enumerate(ds.sample_ids(5, 1).tolist()):
        assert batch["input_ids"][row].tolist() == flat_windows[sid][:-1]
        assert batch["label_ids"][row].tolist() == flat_windows[sid][1:]


def test_uint32_tokens(tmp_path: Path) -> None:
    _write_ds(tmp_path / "d", [100], token_size=4, vocab=100_000, with_manifest=False)
    ds = DatatroveTokenDataset(tmp_path / "d", 9, 1, 1, seed=0, shuffle=False)
    assert ds.token_size == 4 and ds.vocab_size is None
    assert ds.sample(3).tolist() == list(range(30, 40))
    with pytest.raises(ValueError, match="token id 99 .* >= the model vocab size 50"):
        ds.check_vocab(50)
    ds.check_vocab(100)


_CHILD = """
import json, sys
from nanotron_recover.data import DatatroveTokenDataset, SyntheticTokenDataset
ds = DatatroveTokenDataset(sys.argv[1], 6, 2, 3, seed=123)
syn = SyntheticTokenDataset(300, 6, 2, 3, seed=123)
out = {"ids": [ds.sample_ids(s, i).tolist() for s in range(40) for i in range(3)],
       "tokens": [ds.microbatch(s, i)["input_ids"].tolist() for s in (0, 17, 39) for i in range(3)],
       "syn": [syn.microbatch(s, i)["label_ids"].tolist() for s in (0, 5, 1000) for i in range(3)]}
print(json.dumps(out))
"""


def test_identical_across_processes(tmp_path: Path) -> None:
    _write_ds(tmp_path / "d", [300, 200], vocab=500)
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "d")], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONHASHSEED": str(h)})
        for h in (1, 2)
    ]
    outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    ds = DatatroveTokenDataset(tmp_path / "d", 6, 2, 3, seed=123)
    assert outputs[0]["ids"] == [ds.sample_ids(s, i).tolist() for s in range(40) for i in range(3)]


def test_resume_lands_on_next_unread_sample(tmp_path: Path) -> None:
    _write_ds(tmp_path / "d", [400], vocab=500)
    args = (tmp_path / "d", 6, 2, 3)
    uninterrupted = DatatroveTokenDataset(*args, seed=5)
    full = [uninterrupted.microbatch(s, i)["input_ids"] for s in range(20) for i in range(3)]
    first = DatatroveTokenDataset(*args, seed=5)
    part1 = [first.microbatch(s, i)["input_ids"] for s in range(8) for i in range(3)]
    resumed = DatatroveTokenDataset(*args, seed=5)  # a new process after a restart at step 8
    part2 = [resumed.microbatch(s, i)["input_ids"] for s in range(8, 20) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(full, part1 + part2))
    last_read = first.stream_positions(7, 2)[-1]
    assert resumed.stream_positions(8, 0)[0] == last_read + 1
    other_seed = DatatroveTokenDataset(*args, seed=6)
    assert not np.array_equal(other_seed.sample_ids(0, 0), uninterrupted.sample_ids(0, 0))


def test_permutation_is_pinned() -> None:
    """The shuffle is part of the training trajectory: changing it silently would break resumes."""
    assert stream_permutation(10, 0, 0).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert stream_permutation(5, 123, 4).tolist() == stream_permutation(5, 123, 4).tolist()


def test_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DatatroveTokenDataset(tmp_path / "missing", 8, 1, 1, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no datatrove token files \(\*\.ds\)"):
        DatatroveTokenDataset(tmp_path / "empty", 8, 1, 1, seed=0)
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "000_tokens.ds").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        DatatroveTokenDataset(tmp_path / "zero", 8, 1, 1, seed=0)
    _write_ds(tmp_path / "small", [30, 50])
    with pytest.raises(ValueError, match="sequence_length 64 is longer than the available data.*holds 50"):
        DatatroveTokenDataset(tmp_path / "small", 64, 1, 1, seed=0)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "000_tokens.ds").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a multiple"):
        DatatroveTokenDataset(tmp_path / "odd", 1, 1, 1, seed=0)
    ds = DatatroveTokenDataset(tmp_path / "small", 8, 1, 2, seed=0)
    with pytest.raises(ValueError, match="microbatch index 2"):
        ds.microbatch(0, 2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        ds.microbatch(-1, 0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        DatatroveTokenDataset(tmp_path / "small", 8, 0, 2, seed=0)


def test_synthetic_is_deterministic_and_learnable() -> None:
    syn = SyntheticTokenDataset(vocab_size=32000, sequence_length=64, micro_batch_size=4, microbatches_per_step=2,
                                seed=3)
    again = SyntheticTokenDataset(32000, 64, 4, 2, seed=3)
    a, b = syn.microbatch(9, 1), again.microbatch(9, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], syn.microbatch(9, 0)["input_ids"])
    assert a["input_ids"].dtype == torch.int64 and a["input_ids"].shape == (4, 64)
    assert torch.equal(a["input_ids"][:, 1:], a["label_ids"][:, :-1])
    ids = torch.cat([syn.microbatch(s, i)["input_ids"] for s in range(20) for i in range(2)])
    assert int(ids.min()) >= 0 and int(ids.max()) < 32000
    succ = {int(x): int(y) for x, y in zip(syn.cycle, np.roll(syn.cycle, -1))}
    pairs = list(zip(ids[:, :-1].flatten().tolist(), ids[:, 1:].flatten().tolist()))
    predictable = sum(succ.get(x) == y for x, y in pairs) / len(pairs)
    assert 0.75 < predictable < 0.86  # ~ (1 - noise)^2: the bigram structure a model can learn
    syn.check_vocab(32000)
    with pytest.raises(ValueError, match="larger than the model vocab"):
        syn.check_vocab(1000)


def test_build_dataset(tmp_path: Path) -> None:
    _write_ds(tmp_path / "d", [1000], vocab=1000)
    tokens = SimpleNamespace(sequence_length=8, micro_batch_size=2, train_steps=10, batch_accumulation_per_replica=2)
    syn = build_dataset(SimpleNamespace(dataset=None, seed=4), tokens, 4, model_vocab_size=128)
    assert isinstance(syn, SyntheticTokenDataset) and syn.vocab_size == 128 and syn.microbatches_per_step == 4
    spec = SimpleNamespace(dataset_folder=str(tmp_path / "d"), shuffle=False)
    ds = build_dataset(SimpleNamespace(dataset=spec, seed=4), tokens, 4, model_vocab_size=1000)
    assert isinstance(ds, DatatroveTokenDataset) and not ds.shuffle and ds.seed == 4
    ds = build_dataset({"dataset": {"dataset_folder": str(tmp_path / "d")}, "seed": None}, tokens, 4, None)
    assert ds.shuffle and ds.seed == 0
    with pytest.raises(ValueError, match=">= the model vocab size 512"):
        build_dataset(SimpleNamespace(dataset=spec, seed=4), tokens, 4, model_vocab_size=512)
    with pytest.raises(ValueError, match="prepare-data"):
        build_dataset(SimpleNamespace(dataset=SimpleNamespace(hf_dataset_or_datasets="c4"), seed=1), tokens, 4, 1000)
