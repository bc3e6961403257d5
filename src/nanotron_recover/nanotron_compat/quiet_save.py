"""nanotron's weight save without its progress bar.

nanotron 0.4's ``serialize.weights.save_weights`` wraps its loop in ``tqdm(..., desc="Saving weights")`` with no
``disable`` and no parameter to pass one (its loading bars are disabled off rank 0; this one is not): every writing
rank draws a bar at every save, which buries the run's own lines. The module's ``tqdm`` is replaced, where
``save_weights`` looks it up, by one that disables exactly that bar; every other bar, and the save itself, is
nanotron's. Nothing else is redirected: a process-wide stderr redirect would also swallow the watcher's and the
hang monitor's lines written from other threads during a save.
"""

from __future__ import annotations

from typing import Any

import nanotron.serialize.weights as _weights
from tqdm import tqdm

SAVE_BAR = "Saving weights"


def _tqdm_without_the_save_bar(*args: Any, **kwargs: Any) -> tqdm:
    if kwargs.get("desc") == SAVE_BAR:
        kwargs["disable"] = True
    return tqdm(*args, **kwargs)


def install_quiet_weight_save() -> None:
    """Make ``nanotron.serialize.weights.save_weights`` draw no progress bar (idempotent)."""
    _weights.tqdm = _tqdm_without_the_save_bar
