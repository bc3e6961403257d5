"""Models built from nanotron's parallel building blocks that run on CPU (gloo) and GPU."""
