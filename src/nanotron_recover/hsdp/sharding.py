"""FSDP2 inside one replica: shard the model, split microbatch rows over the shard group, clip shards.

Why the rows of each microbatch are split (and not whole microbatches dealt out): FSDP2's collectives need every
rank of the shard group to run the same number of forward/backward passes, while the planner hands a replica any
number of microbatches. Splitting rows keeps the passes equal and the math exact: every row has the same token
count and the loss is a token mean, so the F partial losses, each divided by ``M * F``, sum to the microbatch's
loss / M. That holds while every shard has as many unmasked labels as the others (the datasets here mask none);
:func:`local_rows` refuses a microbatch where it does not, rather than change the math silently.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from nanotron_recover.run import devices


def shard_replica_model(
    model: torch.nn.Module, group: torch_dist.ProcessGroup, compute_dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (embedding, final norm, LM head), over ``group``.

    ``compute_dtype`` below fp32: FSDP2 mixed precision: the sharded parameters stay fp32 (they are the optimizer's
    master weights), forward/backward run on parameters gathered in ``compute_dtype``, and gradients are
    reduce-scattered in fp32 (nanotron's recipe: fp32 accumulation and reduction).

    Parameters are replaced by sharded ``DTensor`` parameters (dim 0 split over the group), in place: ``model``
    is returned for convenience. Gradients are reduce-scattered with a plain SUM (no 1/F averaging: the loss
    scaling already accounts for the row split), which gloo supports.
    """
    mesh = DeviceMesh.from_group(group, device_type=devices.compute_device().type)
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    for block in model.model.decoder:
        fully_shard(block.pp_block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():  # the setting is per FSDP unit, not inherited from the root
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def local_rows(microbatch: dict[str, torch.Tensor], shard: int, num_shards: int) -> dict[str, torch.Tensor]:
    """Rows ``[shard * b/F, (shard + 1) * b/F)`` of every tensor of a microbatch (views, no copy)."""
    rows = next(iter(microbatch.values())).shape[0]
    if rows % num_shards:
        raise ValueError(f"a microbatch of {rows} rows cannot be split over {num_shards} shards")
    per = rows // num_shards
    mask = microbatch.get("label_mask")
    if mask is not None and num_shards > 1:
        counts = mask.reshape(num_shards, -1).sum(dim=1)
        if not bool((counts == counts[0]).all()):
            raise ValueError(
                f"the row shards of a microbatch hold {counts.tolist()} unmasked labels: the HSDP row split is exact "
                "only with equal counts (its loss weights each shard 1/F)"
            )
    return {key: value[shard * per : (shard + 1) * per] for key, value in microbatch.items()}
