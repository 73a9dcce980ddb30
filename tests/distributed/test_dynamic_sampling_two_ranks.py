"""Dynamic sampling under data parallelism (two processes, gloo): every rank fills its share of the generation batch
with groups that have reward spread, from prompts no other rank drew, and the batch keeps its shape."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun_ok

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


def test_two_ranks_keep_only_groups_with_spread(tmp_path):
    torchrun_ok(tmp_path, worker=HERE / "dynamic_sampling_worker.py")
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    for rank in ranks:
        assert len(rank["seen"]) == 2
        for batch in rank["seen"]:
            assert len(batch["prompts"]) == 8
            groups = batch["rewards"].sum(1).view(-1, 4)
            assert all(len(set(g.tolist())) > 1 for g in groups)
            assert all(int(p[1:]) % 3 == 0 for p in batch["prompts"])  # only 'easy' prompts have spread
            assert batch["advantages"].abs().sum() > 0
        assert rank["refill_position"] > 0
    # the logged metrics are the same on both ranks (reduced over them)
    assert ranks[0]["logs"][0]["dynamic_sampling/filtered_frac"] == ranks[1]["logs"][0]["dynamic_sampling/filtered_frac"]
    # the replacement prompts of the two ranks are different ones
    refilled = [{p for b in rank["seen"] for p in b["prompts"]} for rank in ranks]
    assert refilled[0] != refilled[1]
