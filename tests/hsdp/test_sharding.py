"""The row split of a microbatch over an FSDP shard group (pure)."""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.hsdp.sharding import local_rows


def microbatch(rows: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * 5).view(rows, 5)
    mask = torch.ones(rows, 5, dtype=torch.bool)
    return {"input_ids": ids, "label_ids": ids + 1, "input_mask": mask, "label_mask": mask.clone()}


@pytest.mark.parametrize("rows, shards", [(4, 2), (6, 3), (4, 4), (3, 1)])
def test_shards_partition_the_rows_in_order(rows, shards):
    mb = microbatch(rows)
    parts = [local_rows(mb, f, shards) for f in range(shards)]
    for key, full in mb.items():
        assert torch.equal(torch.cat([p[key] for p in parts]), full)
        assert all(p[key].shape[0] == rows // shards for p in parts)


def test_rows_are_views_not_copies():
    mb = microbatch(4)
    part = local_rows(mb, 1, 2)
    assert part["input_ids"].data_ptr() == mb["input_ids"][2:].data_ptr()


def test_rows_that_do_not_split_evenly_are_rejected():
    with pytest.raises(ValueError, match="cannot be split"):
        local_rows(microbatch(5), 0, 2)


def test_unequal_label_counts_across_shards_are_rejected():
    mb = microbatch(4)
    mb["label_mask"][0, :2] = False  # shard 0 would weigh its 8 labels like shard 1's 10
    with pytest.raises(ValueError, match="unmasked labels"):
        local_rows(mb, 1, 2)
    mb["label_mask"][3, :2] = False  # equal counts again: exact
    assert local_rows(mb, 1, 2)["label_mask"].sum() == 8
