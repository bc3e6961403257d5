"""Make nanotron 0.4 importable.

nanotron 0.4 on PyPI has a true import cycle (upstream issues #191, #235):
``nanotron.logging`` needs ``nanotron.config.config.LoggingArgs`` at import time, and
``nanotron.config.config`` (through ``pipeline_parallel.engine``) needs ``nanotron.logging.get_logger`` at
import time. No import order breaks it. We load nanotron's *own* ``logging.py`` with that single import
deferred (``LoggingArgs`` appears there only as an annotation), then import the config package and bind the
real class. Every other nanotron module then imports normally. This is the only place that does it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

_CYCLE_MODULE = "nanotron.config.config"


def _load_nanotron_logging() -> None:
    spec = importlib.util.find_spec("nanotron.logging")
    if spec is None or spec.loader is None or spec.origin is None:
        raise ImportError("nanotron is not installed: pip install nanotron==0.4")
    source = spec.loader.get_source("nanotron.logging")
    tree = ast.parse(source, filename=spec.origin)
    deferred = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == _CYCLE_MODULE]
    tree.body = [n for n in tree.body if n not in deferred]
    module = importlib.util.module_from_spec(spec)
    for node in deferred:
        for alias in node.names:
            # a placeholder for annotations evaluated at def time; replaced below by the real class
            module.__dict__[alias.asname or alias.name] = None
    sys.modules["nanotron.logging"] = module
    try:
        exec(compile(tree, spec.origin, "exec"), module.__dict__)  # nanotron's own code, one import deferred
    except BaseException:
        del sys.modules["nanotron.logging"]
        raise
    import nanotron

    nanotron.logging = module  # type: ignore[attr-defined]
    config_module = importlib.import_module(_CYCLE_MODULE)
    for node in deferred:
        for alias in node.names:
            module.__dict__[alias.asname or alias.name] = getattr(config_module, alias.name)


def ensure_nanotron_importable() -> None:
    """Idempotent: after it, ``import nanotron.<anything>`` works (but modules needing flash_attn)."""
    if "nanotron.logging" in sys.modules and "nanotron.config.config" in sys.modules:
        return
    try:
        importlib.import_module("nanotron.config")
        return
    except ImportError:
        for name in [m for m in sys.modules if m == "nanotron.logging" or m.startswith("nanotron.config")]:
            del sys.modules[name]
    _load_nanotron_logging()
