"""Tools and environments under data parallelism (two processes, gloo): every rank runs its own rollouts' tool calls
in its own environments, rewards from each rank's environments, metrics reduced over ranks, weights in step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun_ok

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


def test_two_ranks_with_their_own_environments(tmp_path):
    torchrun_ok(tmp_path, worker=HERE / "tools_worker.py")
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    for rank in ranks:
        assert len(rank["seen"]) == 2
        for batch in rank["seen"]:
            assert len(set(batch["prompts"])) == 1 and len(batch["prompts"]) == 4  # one group per rank and step
            # columns: used_tool, then the environment's get_reward (the rows that called increment hit 5)
            assert batch["rewards"].tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
            assert len(batch["environments"]) == 4  # one instance per rollout, kept from step to step
        assert rank["seen"][0]["environments"] == rank["seen"][1]["environments"]
        assert rank["logs"][0]["tools/call_frequency"] == 0.5 and rank["logs"][0]["rewards/Counter/mean"] == 0.5
    prompts = [{p for b in rank["seen"] for p in b["prompts"]} for rank in ranks]
    assert not prompts[0] & prompts[1]  # the ranks worked on different prompts
    assert ranks[0]["logs"] == ranks[1]["logs"]
    for name, w in ranks[0]["weights"].items():
        torch.testing.assert_close(w, ranks[1]["weights"][name])
