"""Nothing hangs under data parallelism (two processes, gloo; one launch, tests/distributed/hangs_worker.py): user code
that hangs on one rank is abandoned there while the other rank waits at most the bound; a stop is taken by every rank
together, naming the rank that asked for it. (The watchdog under two processes: test_stall_two_ranks.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
LAUNCH_GUARD_S = 900  # a hang guard only: the launch takes about a minute on a loaded 2-core machine


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("hangs")
    result = torchrun(out, worker=HERE / "hangs_worker.py", timeout=LAUNCH_GUARD_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").is_file() else None
             for r in range(2)]
    assert all(ranks), f"a rank did not finish the four runs:\n{result.stderr[-4000:]}"
    return result, ranks


def test_a_hang_on_one_rank_is_abandoned_there_and_both_ranks_train_on(launch):
    _, ranks = launch
    for name, counters in (("sync_none", {"rewards/judge/timeout_total": 1.0, "tools/timeout_total": 4.0,
                                          "tools/wait_for_it/timeout_total": 4.0}),
                           ("async_none", {"rewards/Slow/timeout_total": 4.0})):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["stopped"] is None and r0["steps"] == r1["steps"] == 2
        assert r0["logs"] == r1["logs"]  # reduced over the ranks: the same on both
        for log in r0["logs"]:  # counted where they happened, summed over the ranks
            assert {k: v for k, v in log.items() if k.endswith("timeout_total")} == counters
        for n, w in r0["weights"].items():
            torch.testing.assert_close(w, r1["weights"][n], atol=0, rtol=0)
    assert ranks[0]["sync_none"]["logs"][0]["tools/failure_frequency"] == 0.5  # rank 0's calls all failed, rank 1's not


def test_a_stop_on_one_rank_stops_every_rank_with_its_cause(launch):
    _, ranks = launch
    for rank in ranks:
        assert rank["sync_stop"]["stopped"] == (
            "rank 1 stopped the run: reward function 'judge' did not return within 0.5 s on the batch of 4 completions "
            "(rows 0-3; first prompt 'Go 10.') (reward_timeout_action='stop')")
        assert rank["async_stop"]["stopped"] == (
            "rank 0 stopped the run: rollout_func did not return within 0.5 s on 4 prompts; a rollout_func that times "
            "out stops the run (nothing to train on)")
        assert rank["sync_stop"]["steps"] == rank["async_stop"]["steps"] == 0
