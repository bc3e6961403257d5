"""Random-state sync without CUDA.

nanotron 0.4's ``random.get_synced_random_state`` broadcasts the state with ``device=torch.device("cuda")`` and
``helpers.init_random_states`` calls it; both fail on a CPU-only host. Same semantics here (tp rank 0's state is the
reference), on the project's compute device. The Llama of this project has no dropout, so this only matters for
checkpoint round trips of ``RandomStates`` (nanotron's ``save_random_states``).
"""

from __future__ import annotations

from typing import Optional

import nanotron_recover.nanotron_compat  # noqa: F401  (nanotron import-cycle fix, must precede nanotron)
from nanotron import distributed as dist
from nanotron.config import ParallelismArgs
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.random import RandomState, RandomStates, get_current_random_state

from nanotron_recover import devices


def get_synced_random_state(random_state: RandomState, pg: dist.ProcessGroup) -> RandomState:
    """Group rank 0's ``random_state`` on every rank of ``pg``."""
    holder = [random_state if dist.get_rank(pg) == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(pg, 0), group=pg, device=devices.compute_device())
    assert holder[0] is not None
    return holder[0]


def init_random_states(parallel_config: Optional[ParallelismArgs], tp_pg: dist.ProcessGroup) -> RandomStates:
    """nanotron's policy: a ``tp_synced`` state under ALL_REDUCE, none under REDUCE_SCATTER."""
    if parallel_config is None or parallel_config.tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        return RandomStates({"tp_synced": get_synced_random_state(get_current_random_state(), pg=tp_pg)})
    return RandomStates({})
