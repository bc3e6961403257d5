"""Samples addressable by (step, microbatch index), so any replica can compute any microbatch.

ReCoVer keeps the *identity* of each step's samples, whoever computes them: global microbatch
``g = step * M + index`` holds rows ``g*mbs .. g*mbs+mbs-1`` of one fixed sample stream. The stream is a pure
function of the data and the seed (a per-epoch permutation from a counter-based hash, no RNG state, no
communication), so every process agrees on it and resuming at step ``s`` is free.

``DatatroveTokenDataset`` reads datatrove token files (``*.ds``: raw little-endian uint16/uint32 tokens) with
``np.memmap``; a sample is a window of ``sequence_length + 1`` tokens, laid out exactly as
``datatrove.utils.dataset.DatatroveFolderDataset`` lays them out (files in sorted order, consecutive
non-overlapping windows, the tail of each file dropped). ``SyntheticTokenDataset`` generates a noisy repeating
pattern the model can learn, for runs without data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "TokenDataset",
    "DatatroveTokenDataset",
    "SyntheticTokenDataset",
    "stream_permutation",
]

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


@runtime_checkable
class TokenDataset(Protocol):
    """What the trainer calls: one microbatch of nanotron's LM batch format per (step, index)."""

    vocab_size: int | None

    def microbatch(self, step: int, index: int) -> dict[str, torch.Tensor]: ...


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a fixed, version-independent bijection on uint64 (the hash behind all shuffles)."""
    with np.errstate(over="ignore"):
        z = x + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def _hash(*parts: int | np.ndarray) -> np.ndarray:
    """Hash a tuple of integers (arrays broadcast) into uint64 values."""
    h = _mix64(np.asarray(parts[0] & _MASK64 if isinstance(parts[0], int) else parts[0], dtype=_U64))
    for part in parts[1:]:
        value = np.asarray(part & _MASK64 if isinstance(part, int) else part, dtype=_U64)
        h = _mix64(h ^ value)
    return h


def stream_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Seeded permutation of ``range(num_samples)`` for one epoch (int64), identical on every process.

    It sorts sample ids by a keyed hash instead of drawing from an RNG, so it does not depend on numpy's
    generator algorithms or on any state: ``(num_samples, seed, epoch)`` alone decide it.
    """
    keys = _hash(seed, epoch, np.arange(num_samples, dtype=_U64))
    return np.argsort(keys, kind="stable").astype(np.int64)


class _AddressableStream:
    """Maps (step, index) to sample-stream positions and builds nanotron LM batches; subclasses give tokens."""

    vocab_size: int | None

    def __init__(self, sequence_length: int, micro_batch_size: int, microbatches_per_step: int, seed: int) -> None:
        for name, value in (
            ("sequence_length", sequence_length),
            ("micro_batch_size", micro_batch_size),
            ("microbatches_per_step", microbatches_per_step),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.sequence_length = int(sequence_length)
        self.micro_batch_size = int(micro_batch_size)
        self.microbatches_per_step = int(microbatches_per_step)
        self.seed = int(seed)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.microbatches_per_step

    def stream_positions(self, step: int, index: int) -> np.ndarray:
        """Positions in the sample stream of global microbatch ``step * M + index`` (``mbs`` of them)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= index < self.microbatches_per_step:
            raise ValueError(f"microbatch index {index} outside [0, {self.microbatches_per_step})")
        g = step * self.microbatches_per_step + index
        start = g * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def sample_ids(self, step: int, index: int) -> np.ndarray:
        """Ids of the samples in microbatch (step, index); equal to the stream positions unless shuffled."""
        return self._ids_at(self.stream_positions(step, index))

    def _ids_at(self, positions: np.ndarray) -> np.ndarray:
        return positions

    def _windows(self, sample_ids: np.ndarray) -> np.ndarray:
        """Token windows ``[len(sample_ids), sequence_length + 1]`` for the given sample ids."""
        raise NotImplementedError

    def microbatch(self, step: int, index: int) -> dict[str, torch.Tensor]:
        """Nanotron's LM batch for global microbatch ``step * M + index``: inputs and next-token labels."""
        windows = torch.from_numpy(self._windows(self.sample_ids(step, index)).astype(np.int64, copy=False))
        shape = (self.micro_batch_size, self.sequence_length)
        return {
            "input_ids": windows[:, :-1].contiguous(),
            "input_mask": torch.ones(shape, dtype=torch.bool),
            "label_ids": windows[:, 1:].contiguous(),
            "label_mask": torch.ones(shape, dtype=torch.bool),
        }


def _token_size_of(folder: Path, files: list[Path]) -> tuple[int, dict]:
    """Token width in bytes from ``dataset.json``, else from datatrove's ``<file>.metadata`` ("name|size")."""
    manifest: dict = {}
    manifest_path = folder / "dataset.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if "token_size" in manifest:
            return int(manifest["token_size"]), manifest
    for path in files:
        meta = path.with_name(path.name + ".metadata")
        if meta.is_file():
            first = meta.read_text(encoding="utf-8").splitlines()[0]
            if "|" in first:
                return int(first.rsplit("|", 1)[1]), manifest
    return 2, manifest  # datatrove's default for vocabularies up to 65,536


class DatatroveTokenDataset(_AddressableStream):
    """Fixed-length samples over the ``*.ds`` files of a ``prepare-data`` (or any datatrove) output folder."""

    def __init__(
        self,
        folder: str | Path,
        sequence_length: int,
        micro_batch_size: int,
        microbatches_per_step: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        super().__init__(sequence_length, micro_batch_size, microbatches_per_step, seed)
        self.folder = Path(folder).expanduser()
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"dataset folder {self.folder} does not exist; create it with `nanotron-recover prepare-data`"
            )
        files = sorted(p for p in self.folder.glob("*.ds") if p.is_file())
        if not files:
            raise FileNotFoundError(
                f"dataset folder {self.folder} holds no datatrove token files (*.ds); "
                f"run `nanotron-recover prepare-data --output {self.folder}` first"
            )
        self.token_size, self.manifest = _token_size_of(self.folder, files)
        if self.token_size not in (2, 4):
            raise ValueError(f"unsupported token size {self.token_size} bytes in {self.folder}")
        dtype = np.dtype("<u2" if self.token_size == 2 else "<u4")
        self.vocab_size = int(self.manifest["vocab_size"]) if "vocab_size" in self.manifest else None
        self.shuffle = bool(shuffle)
        window = self.sequence_length + 1
        self.files: list[Path] = []
        self._tokens: list[np.ndarray] = []
        counts: list[int] = []
        for path in files:
            size = path.stat().st_size
            if size % self.token_size:
                raise ValueError(f"{path} is {size} bytes, not a multiple of the {self.token_size}-byte token size")
            if size == 0:
                continue
            tokens = np.memmap(path, dtype=dtype, mode="r")
            self.files.append(path)
            self._tokens.append(tokens)
            counts.append(len(tokens) // window)
        self.num_tokens = int(sum(len(t) for t in self._tokens))
        if self.num_tokens == 0:
            raise ValueError(f"dataset folder {self.folder} is empty: its *.ds files hold no tokens")
        self.num_samples = int(sum(counts))
        if self.num_samples == 0:
            largest = max(len(t) for t in self._tokens)
            raise ValueError(
                f"sequence_length {self.sequence_length} is longer than the available data: a sample needs "
                f"{window} tokens but the largest token file in {self.folder} holds {largest}"
            )
        self._file_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._perm_cache: dict[int, np.ndarray] = {}
        self._max_token_id: int | None = None

    @property
    def steps_per_epoch(self) -> float:
        return self.num_samples / self.samples_per_step

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = stream_permutation(self.num_samples, self.seed, epoch)
            if len(self._perm_cache) >= 2:  # a microbatch spans at most two epochs
                self._perm_cache.pop(min(self._perm_cache))
            self._perm_cache[epoch] = perm
        return perm

    def _ids_at(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.num_samples)
        if not self.shuffle:
            return offsets
        ids = np.empty_like(offsets)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            ids[sel] = self._permutation(int(epoch))[offsets[sel]]
        return ids

    def _windows(self, sample_ids: np.ndarray) -> np.ndarray:
        window = self.sequence_length + 1
        out = np.empty((len(sample_ids), window), dtype=np.int64)
        file_idx = np.searchsorted(self._file_starts, sample_ids, side="right") - 1
        for row, (sid, fid) in enumerate(zip(sample_ids.tolist(), file_idx.tolist())):
            start = (sid - int(self._file_starts[fid])) * window
            out[row] = self._tokens[fid][start : start + window]
        return out

    def sample(self, sample_id: int) -> np.ndarray:
        """Tokens (``sequence_length + 1``) of sample ``sample_id`` in file order (not shuffled)."""
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f"sample id {sample_id} outside [0, {self.num_samples})")
        return self._windows(np.asarray([sample_id], dtype=np.int64))[0]

    def max_token_id(self) -> int:
        """Largest token id stored (scans the files once, in chunks)."""
        if self._max_token_id is None:
            chunk = 1 << 24
            self._max_token_id = max(
                int(tokens[i : i + chunk].max()) for tokens in self._tokens for i in range(0, len(tokens), chunk)
            )
        return self._max_token_id

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse data whose token ids do not fit the model's embedding (they would crash or silently alias)."""
        top = self.max_token_id()
        if top >= model_vocab_size:
            tokenizer = f" (tokenizer vocab {self.vocab_size})" if self.vocab_size is not None else ""
            raise ValueError(
                f"token id {top} in {self.folder} is >= the model vocab size {model_vocab_size}{tokenizer}; "
                "set model.model_config.vocab_size to at least the tokenizer's vocab size"
            )

    def __repr__(self) -> str:
        return (
            f"DatatroveTokenDataset({str(self.folder)!r}, tokens={self.num_tokens}, samples={self.num_samples}, "
            f"seq_len={self.sequence_length}, mbs={self.micro_batch_size}, M={self.microbatches_per_step}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )


class SyntheticTokenDataset(_AddressableStream):
    """An endless deterministic stream with learnable structure: a noisy walk around a fixed token cycle.

    A seed-chosen cycle of ``pattern_size`` distinct tokens is walked from a per-sample offset; each token is
    replaced by a uniform random one with probability ``noise``. The next token is predictable from the previous
    clean one, so the loss falls from ``ln(vocab_size)`` toward the noise floor. Sample ``k`` is a pure hash of
    ``(seed, k)``: no state, no epochs.
    """

    def __init__(
        self,
        vocab_size: int,
        sequence_length: int,
        micro_batch_size: int,
        microbatches_per_step: int,
        seed: int,
        noise: float = 0.1,
        pattern_size: int = 512,
    ) -> None:
        super().__init__(sequence_length, micro_batch_size, microbatches_per_step, seed)
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.vocab_size = int(vocab_size)
        self.noise = float(noise)
        size = min(int(pattern_size), self.vocab_size)
        # the cycle: the `size` tokens with the smallest keyed hash, in hash order
        self.cycle = stream_permutation(self.vocab_size, self.seed, -1)[:size]
        self._noise_threshold = _U64(min(int(self.noise * 2.0**64), _MASK64))

    def _windows(self, sample_ids: np.ndarray) -> np.ndarray:
        window = self.sequence_length + 1
        ids = sample_ids.astype(_U64)[:, None]
        pos = np.arange(window, dtype=_U64)[None, :]
        offset = (_hash(self.seed, 1, sample_ids.astype(_U64)) % _U64(len(self.cycle))).astype(np.int64)
        clean = self.cycle[(offset[:, None] + np.arange(window)[None, :]) % len(self.cycle)]
        flip = _hash(self.seed, 2, ids, pos) < self._noise_threshold
        random_tokens = (_hash(self.seed, 3, ids, pos) % _U64(self.vocab_size)).astype(np.int64)
        return np.where(flip, random_tokens, clean)

    def check_vocab(self, model_vocab_size: int) -> None:
        """The synthetic stream draws ids below ``vocab_size``; the model must cover them."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"synthetic data vocab size {self.vocab_size} is larger than the model vocab size {model_vocab_size}"
            )

    def __repr__(self) -> str:
        return (
            f"SyntheticTokenDataset(vocab={self.vocab_size}, seq_len={self.sequence_length}, "
            f"mbs={self.micro_batch_size}, M={self.microbatches_per_step}, seed={self.seed}, noise={self.noise})"
        )
