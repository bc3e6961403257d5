"""The one place that works around nanotron 0.4's CPU-hostile spots and its import cycle.

Import this package before any ``nanotron`` module. Each workaround names the nanotron limitation it covers.
"""

from nanotron_recover.nanotron_compat.imports import ensure_nanotron_importable

ensure_nanotron_importable()
