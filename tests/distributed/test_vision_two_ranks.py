"""Vision-language training under data parallelism (two processes, gloo, one launch): each rank encodes and trains
on its own prompts' pictures, the weights stay in step, the vision tower trains; and a rank whose batches are text
only takes part without hanging (DDP looks for unused parameters with a VLM, TRL's rule)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun_ok

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


def test_two_ranks_train_on_their_own_pictures(tmp_path):
    torchrun_ok(tmp_path, worker=HERE / "vision_worker.py")
    for scenario in ("images", "mixed"):
        ranks = [torch.load(tmp_path / f"{scenario}_rank{i}.pt", weights_only=False) for i in range(2)]
        assert all(r["find_unused"] is True for r in ranks)
        assert ranks[0]["logs"] == ranks[1]["logs"] and len(ranks[0]["logs"]) == 2
        for name, w in ranks[0]["after"].items():
            torch.testing.assert_close(w, ranks[1]["after"][name], msg=name)
        moved = {n for n, w in ranks[0]["after"].items() if not torch.equal(w, ranks[0]["before"][n])}
        assert any(n.startswith("model.visual.") for n in moved) and "lm_head.weight" in moved
        pictures = [{p for batch in r["seen"] for p in batch} for r in ranks]
        assert not pictures[0] & pictures[1] - {None}  # each rank scored its own prompts' pictures
        if scenario == "images":
            assert None not in pictures[0] | pictures[1]
            assert {n for n in ranks[0]["before"]} == moved  # every parameter moved
        else:
            assert pictures[1] == {None} and None not in pictures[0]  # rank 1 trained on text alone
