"""torch's AdamW without the import of torch's compiler on its first call.

torch keeps ``torch.compile`` out of its optimizers with two wrappers: ``Optimizer.add_param_group``,
``zero_grad``, ``state_dict``, ``load_state_dict`` and the functional ``adam`` go through ``torch._disable_dynamo``,
and ``Adam.step`` (AdamW's) through a wrapper that calls ``torch._dynamo.graph_break()``. Both import
``torch._dynamo`` on first use: ~1.5 CPU-s per process on a 2-core machine (sympy, the tracer's rules), about 40 %
of what a rank imports. Every start pays it, cold or warm, and so does each rank of a warm standby (its imports
are what it is there to do ahead, on cores the training shares). Nothing in this project is ever compiled, so the
wrappers would only import.

:class:`EagerAdamW` is torch's AdamW, its arithmetic untouched: its ``step`` calls the function torch's wrapper
wraps, under ``no_grad`` (what the wrapper sets for a non-differentiable optimizer), and :func:`skip_dynamo_import`
fills the cache slot that ``torch._disable_dynamo`` fills on its first call (the function it would run) with the
wrapped function itself. Where a torch version lays these out otherwise (no ``__wrapped__``), nothing is changed
and torch imports its compiler as before. Where ``torch._dynamo`` is already imported (somebody compiles in this
process), nothing is changed either.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
from torch.optim import AdamW, Optimizer
from torch.optim import adam as adam_module

_CACHE_SLOT = "__dynamo_disable"  # the attribute torch._disable_dynamo caches its disabled function in
_DISABLED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
# AdamW's step less every wrapper: torch's dynamo wrapper, and the profiling hook that building any AdamW puts
# around the class's step (then one ``__wrapped__`` would land on the dynamo wrapper); None where it has none
_RAW_STEP = inspect.unwrap(AdamW.step) if hasattr(AdamW.step, "__wrapped__") else None


def _wrapped(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    return getattr(fn, "__wrapped__", None)


def skip_dynamo_import() -> bool:
    """Prime ``torch._disable_dynamo``'s cache for the optimizer functions AdamW runs; False when not done."""
    if "torch._dynamo" in sys.modules:
        return False
    functions = [_wrapped(getattr(Optimizer, name)) for name in _DISABLED_METHODS]
    functions.append(_wrapped(getattr(adam_module, "adam", None)))
    if any(fn is None for fn in functions) or _RAW_STEP is None:
        return False
    for fn in functions:
        if getattr(fn, _CACHE_SLOT, None) is None:
            setattr(fn, _CACHE_SLOT, fn)
    return True


class EagerAdamW(AdamW):
    """torch's AdamW whose first step does not import torch's compiler (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._eager = skip_dynamo_import()
        super().__init__(*args, **kwargs)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if not self._eager or self.defaults.get("differentiable"):
            return super().step(closure)
        with torch.no_grad():
            return _RAW_STEP(self, closure)
