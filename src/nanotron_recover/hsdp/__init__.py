"""HSDP replicas: a replica is an FSDP shard group instead of a TP x PP grid.

The three layers do not change. Each replica is ``fault_tolerance.fsdp_shard_size`` (F) ranks whose own torch world
shards parameters, gradients and Adam state with torch FSDP2 (``fully_shard``); every microbatch's rows are split
over the F ranks, whose reduce-scatter (a SUM) leaves each rank with its shard of the replica's gradient. That
shard is what the flat fp32 buckets hold, so the cross-replica reduction, snapshots, orphan recompute, planner
quotas and spares work shard by shard over the ULFM communicator of each shard coordinate.

* :mod:`.sharding`: shard the Llama, split a microbatch's rows, clip a sharded gradient.
* :mod:`.strategy`: :class:`ShardedReplicaDataParallel`, ReCoVer's data-parallel path for such replicas.
* :mod:`.checkpoint`: the per-rank shard checkpoint format.
"""
