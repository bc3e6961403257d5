"""The one place that works around nanotron 0.4's CPU-hostile spots and its import cycle.

Each workaround names the nanotron limitation it covers. The import-cycle fix (:mod:`.imports`) runs by itself
the first time nanotron is imported after ``import nanotron_recover``: no module imports this package for its
side effect.
"""
