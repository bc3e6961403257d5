"""Process exit codes, in one place: the trainer, the launcher and the Slurm outcome helper speak the same codes.

The launcher (and the Slurm scripts) end with one of three codes, each meaning one thing:

* ``0`` done: the last step is trained (and saved, where the run writes checkpoints);
* ``3`` a relaunch will help: processes or a node were lost, the job was preempted, fewer than ``min_replicas``
  replicas were left, a fault hit the start-up. Slurm requeues;
* ``2`` a person must act: a relaunch would meet the same failure (a config or data error found at start-up, a
  damaged checkpoint with no intact one to fall back to, a full disk, non-finite training, a bug, or the same
  start-up failure on several launches in a row). Never requeued.

Under ``mpirun --with-ft ulfm`` mpirun's own return code says little (it is 0 even when ranks were SIGKILLed), so
each rank also records how it ended in ``<run_dir>/exits/`` (see :func:`nanotron_recover.run.run_folder.record_exit`).
A rank that hits a bug records ``1`` and aborts the job; the launcher reports that as ``2``.
"""

EXIT_DONE = 0  # finished (also a rank whose replica was evicted: it left cleanly)
EXIT_ABORTED = 1  # a rank's record only: a bug, the same error would hit every replica (launcher: EXIT_NEEDS_PERSON)
EXIT_NEEDS_PERSON = 2  # relaunching cannot help until a person acts (see the module docstring)
EXIT_BAD_INPUT = EXIT_NEEDS_PERSON  # the input cannot work (config, data folder, resume source)
EXIT_RESTART = 3  # not finished, a relaunch resumes (below min_replicas, a start-up fault, a lost node, preemption)


class NeedsPerson(RuntimeError):
    """The run cannot go on until a person acts, and every rank knows it (the decision was agreed, or the rank
    ends the job itself): damaged state with nothing intact to fall back to, a full disk, a non-finite step.
    ``what`` is a short kind (``damaged checkpoint``, ``disk full``, ``non-finite step``) for the exit record."""

    def __init__(self, what: str, detail: str, **record: object) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.record = record  # extra fields for the exit record (e.g. the step, the file)
