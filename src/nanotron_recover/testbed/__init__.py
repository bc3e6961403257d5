"""Tools to try faults on one machine (a fake multi-node bed): used by tests, benchmarks and curious users, never
by training."""
