"""vllm_mode="server" with two training processes (a fake of TRL's client; FSDP2 so the pushed weights must be
gathered whole): one client, on the main process, sends every rank's prompts in one request and hands each rank
its rows; weights are pushed whole, once per optimizer step; training equals one process with accumulation."""

import shutil

import pytest
import torch
from launch import load, single, torchrun_ok

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-server")
    torchrun_ok(root / "two", "4", "1", "dapo", "--fake-vllm-server", "--shard", "fsdp2")
    single(root / "one", 4, 2, ["dapo"], 4, "--fake-vllm-server")
    return root


def rows(batch: torch.Tensor) -> list[list[int]]:
    return [[t for t in row.tolist() if t != 0] for row in batch]


def test_one_client_on_the_main_process_serves_every_rank(runs):
    r0, r1 = load(runs / "two" / "dapo-rank0.pt"), load(runs / "two" / "dapo-rank1.pt")
    assert r1["server"] is None  # no second client, no second communicator
    assert [len(r) for r in r0["server"]["requests"]] == [8, 8]  # 2 ranks × 4 prompts in one request
    one = load(runs / "one" / "dapo-rank0.pt")
    assert r0["server"]["requests"] == one["server"]["requests"]
    for whole, c0, c1 in zip(one["completions"], r0["completions"], r1["completions"]):
        assert rows(whole) == rows(c0) + rows(c1)  # each rank trained on its own slice of the answer


def test_weights_are_pushed_whole_after_each_step(runs):
    r0 = load(runs / "two" / "dapo-rank0.pt")
    server = r0["server"]
    # two steps: before the first generation (a server may hold any weights) and after the first update
    assert server["resets"] == 2
    assert set(server["pushed"]) >= set(r0["params"])
    for name, p in r0["params"].items():
        assert server["pushed"][name].shape == p.shape  # FSDP2 shards were gathered before the push


def test_two_ranks_equal_one_rank_with_accumulation(runs):
    one = load(runs / "one" / "dapo-rank0.pt")
    for rank in (0, 1):
        two = load(runs / "two" / f"dapo-rank{rank}.pt")
        for name, p in one["params"].items():
            torch.testing.assert_close(two["params"][name], p, atol=1e-5, rtol=1e-4)
