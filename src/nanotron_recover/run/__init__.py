"""The run: its folder (layout, every reader and writer), the exit codes and verdict, the job shape, the devices,
the phase names, what /proc says of a process, a full disk named and what the launcher shows of the output."""
