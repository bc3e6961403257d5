"""Per-rank entry point the benchmarks launch: ``nanotron_recover.train`` plus one CPU fix for resuming.

nanotron 0.4's ``load_optimizer`` ends with ``check_optim_state_in_sync``, which moves the Adam ``step`` tensor to
``"cuda"`` unconditionally: on a CPU-only torch every resume from a checkpoint dies with "Torch not compiled with
CUDA enabled" (stock path and ReCoVer path alike). The checkpoint-restart baseline resumes on every relaunch, so
until the trainer carries the fix (see benchmarks/RESULTS.md, "Trainer issues found") this entry point replaces
that check, on CPU only, with the same check minus the device move. When the trainer fixes it (the function in
``nanotron.serialize.optimizer`` is no longer nanotron's) or CUDA is present, this file changes nothing.
"""

from __future__ import annotations

import os
import sys


def _patch_cpu_resume() -> None:
    import nanotron_recover.nanotron_compat  # noqa: F401  (nanotron import order)
    import nanotron.serialize.optimizer as serialize_optimizer
    import torch
    from nanotron import sanity_checks

    if torch.cuda.is_available() or serialize_optimizer.check_optim_state_in_sync is not sanity_checks.check_optim_state_in_sync:
        return

    def check_optim_state_in_sync_cpu(optimizer, pg) -> None:
        for _, state in sorted(optimizer.state_dict()["state"].items(), key=lambda kv: kv[0]):
            for name, tensor in state.items():
                sanity_checks.assert_tensor_synced_across_pg(
                    tensor=tensor, pg=pg, msg=lambda err, name=name: f"{name} are not synced across DP {err}"
                )

    serialize_optimizer.check_optim_state_in_sync = check_optim_state_in_sync_cpu


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _patch_cpu_resume()
    from nanotron_recover.train import main

    sys.exit(main(sys.argv[1:]))
