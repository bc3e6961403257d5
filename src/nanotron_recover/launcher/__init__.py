"""The launcher: the `nanotron-recover` command line, the mpirun line and its watch, the command-line overrides,
the preflight checks, and runs launched and measured for tests and benchmarks."""
