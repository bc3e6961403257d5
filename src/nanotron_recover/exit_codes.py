"""Process exit codes, in one place: the trainer, the launcher and the Slurm outcome helper speak the same codes.

Under ``mpirun --with-ft ulfm`` mpirun's own return code says little (it is 0 even when ranks were SIGKILLed), so
each rank also records how it ended in ``<run_dir>/exits/`` (see :func:`nanotron_recover.train.record_exit`).
"""

EXIT_DONE = 0  # finished (also a rank whose replica was evicted: it left cleanly)
EXIT_ABORTED = 1  # a bug, not a fault: the same error would hit every replica
EXIT_BAD_INPUT = 2  # the input cannot work (config, data folder, resume source): relaunching cannot help
EXIT_RESTART = 3  # not finished, relaunch resumes from latest.txt (below min_replicas, a start-up fault, a hang
#                   that no live rank could end)
