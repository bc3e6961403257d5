"""Data for nanotron-recover: offline preparation (``prepare``), addressable samples (``dataset``), and the
embedded default corpus (``corpus``).

The trainer calls :func:`build_dataset` once per process; every process builds the same sample stream, so a
replica can compute any global microbatch after a failure without asking anyone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanotron_recover.data.dataset import (
        DatatroveTokenDataset,
        SyntheticTokenDataset,
        TokenDataset,
        stream_permutation,
    )

_LAZY = {"DatatroveTokenDataset", "SyntheticTokenDataset", "TokenDataset", "stream_permutation"}


def __getattr__(name: str) -> Any:
    """Import the dataset classes on first use, so ``prepare-data`` does not pay for importing torch."""
    if name in _LAZY:
        return getattr(importlib.import_module("nanotron_recover.data.dataset"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "TokenDataset",
    "DatatroveTokenDataset",
    "SyntheticTokenDataset",
    "stream_permutation",
    "build_dataset",
]


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a config dataclass or a plain mapping."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def build_dataset(
    data_config_section: Any,
    tokens_args: Any,
    microbatches_per_step: int,
    model_vocab_size: int | None,
) -> DatatroveTokenDataset | SyntheticTokenDataset:
    """The dataset a ``data:`` config section asks for.

    ``data.dataset`` null -> synthetic tokens over ``model_vocab_size``; an object (or mapping) with
    ``dataset_folder`` (and optional ``shuffle``) -> the datatrove token files there. ``data.seed`` seeds the
    shuffle; ``tokens_args`` gives ``sequence_length`` and ``micro_batch_size``; ``microbatches_per_step`` is M.
    Token ids are checked against ``model_vocab_size`` when it is given.
    """
    from nanotron_recover.data.dataset import DatatroveTokenDataset, SyntheticTokenDataset

    seed = _field(data_config_section, "seed", None)
    seed = 0 if seed is None else int(seed)
    spec = _field(data_config_section, "dataset", None)
    sequence_length = int(_field(tokens_args, "sequence_length"))
    micro_batch_size = int(_field(tokens_args, "micro_batch_size"))
    dataset: DatatroveTokenDataset | SyntheticTokenDataset
    if spec is None:
        if model_vocab_size is None:
            raise ValueError("synthetic data (data.dataset: null) needs the model vocab size")
        dataset = SyntheticTokenDataset(
            vocab_size=int(model_vocab_size),
            sequence_length=sequence_length,
            micro_batch_size=micro_batch_size,
            microbatches_per_step=microbatches_per_step,
            seed=seed,
        )
    else:
        folder = _field(spec, "dataset_folder", None)
        if folder is None:
            raise ValueError(
                f"data.dataset must be null (synthetic) or carry dataset_folder: <path>, got {type(spec).__name__}; "
                "Hugging Face datasets are not read at run time: tokenize them with `nanotron-recover prepare-data`"
            )
        shuffle = _field(spec, "shuffle", True)
        dataset = DatatroveTokenDataset(
            folder,
            sequence_length=sequence_length,
            micro_batch_size=micro_batch_size,
            microbatches_per_step=microbatches_per_step,
            seed=seed,
            shuffle=True if shuffle is None else bool(shuffle),
        )
    if model_vocab_size is not None:
        dataset.check_vocab(int(model_vocab_size))
    return dataset
