"""Make nanotron 0.4 importable.

nanotron 0.4 on PyPI has a true import cycle (upstream issues #191, #235):
``nanotron.logging`` needs ``nanotron.config.config.LoggingArgs`` at import time, and
``nanotron.config.config`` (through ``pipeline_parallel.engine``) needs ``nanotron.logging.get_logger`` at
import time. No import order breaks it. We load nanotron's *own* ``logging.py`` with that single import
deferred (``LoggingArgs`` appears there only as an annotation), then import the config package and bind the
real class. Every other nanotron module then imports normally. This is the only place that does it.

It runs once, when nanotron is first imported: ``import nanotron_recover`` installs :func:`install_import_hook`,
a ``sys.meta_path`` finder that lets the top-level ``nanotron`` package load as usual and runs
:func:`ensure_nanotron_importable` right after it, before any ``nanotron.<module>`` is looked up. So no module
needs a side-effect import before its nanotron imports, and a light tool (``nanotron_recover.run.exit_codes``,
``.metrics``) pays nothing: nanotron, and torch with it, load only for code that imports them.
"""

from __future__ import annotations

import importlib
import sys

# Cheap to import on purpose (``import nanotron_recover`` imports this module): ``ast`` and ``importlib.util``
# are imported when the fix runs, the hook classes follow the finder / loader protocols without subclassing
# ``importlib.abc`` (~15 ms to import), and the annotations need no ``typing`` at run time (~9 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any, Sequence

_CYCLE_MODULE = "nanotron.config.config"


def _load_nanotron_logging() -> None:
    import ast
    import importlib.util

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


class _ShimAfterNanotron:
    """Finds the top-level ``nanotron`` package like the finders after it, and wraps its loader so that the
    shim runs right after ``nanotron/__init__.py``. Removes itself at its first use."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "nanotron":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ShimLoader(spec.loader)
                return spec
        return None  # not installed: the import fails as usual


class _ShimLoader:
    """The real loader of ``nanotron``; after executing the package, puts itself back out of the module's spec
    and makes nanotron importable."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        ensure_nanotron_importable()


def install_import_hook() -> None:
    """Make nanotron importable whenever it gets imported (idempotent). If nanotron is already imported, make
    it importable now."""
    if "nanotron" in sys.modules:
        ensure_nanotron_importable()
    elif not any(isinstance(f, _ShimAfterNanotron) for f in sys.meta_path):
        sys.meta_path.insert(0, _ShimAfterNanotron())
