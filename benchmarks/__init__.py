"""Benchmarks: scripts that print numbers (each runs as ``python benchmarks/X.py`` from the repository root, or as
``python -m benchmarks.X``), and ``benchmarks.lib``, what they share."""
