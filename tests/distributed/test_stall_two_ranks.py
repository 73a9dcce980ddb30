"""``stall_action="save_and_exit"`` under data parallelism (two processes, gloo; tests/distributed/stall_worker.py): a
reward that hangs on one rank stalls the run; each rank's watchdog reports, the ranks agree through files and save
one consistent checkpoint, and both processes end with 124; a resume from it trains as the uninterrupted run did."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun

from grpokit.run.checkpoints import verify_checkpoint

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
LAUNCH_GUARD_S = 900  # a hang guard only: each launch takes under a minute on a loaded 2-core machine


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = tmp_path_factory.mktemp("stall")
    stalled = torchrun(out, "plain-then-stall", worker=HERE / "stall_worker.py", timeout=LAUNCH_GUARD_S)
    resumed = torchrun(out, "resume", worker=HERE / "stall_worker.py", timeout=LAUNCH_GUARD_S)
    return out, stalled, resumed


def test_each_rank_reports_the_ranks_save_one_checkpoint_and_both_end_with_124(launches):
    out, stalled, _ = launches
    err = stalled.stderr
    assert stalled.returncode != 0 and "exitcode: 124" in err, err[-4000:]
    assert "the stalled run returned" not in stalled.stdout
    assert "at step 1, rank 1 of 2: MainThread: scoring (function 'judge') for " in err
    assert "at step 1, rank 0 of 2: MainThread: finishing for " in err  # waiting for rank 1 in the rollout's collective
    saved = (f"grpokit: checkpoint saved to {out / 'stall'}/checkpoint-1; continue with --resume (Python: "
             "resume_from_checkpoint='auto'); exiting with status 124 (stall_action='save_and_exit')")
    assert err.count(saved) == 2, err[-4000:]  # said by each rank
    checkpoint = out / "stall" / "checkpoint-1"
    assert verify_checkpoint(checkpoint) == 1
    assert {p.name for p in checkpoint.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert not list((out / "stall").glob(".stall-rendezvous-*"))  # the meeting place is cleared
    assert not list((out / "stall").glob("checkpoint-1.tmp-*"))


def test_a_resume_from_the_stalled_checkpoint_trains_as_the_uninterrupted_run(launches):
    out, _, resumed = launches
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for rank in range(2):
        plain = torch.load(out / f"plain-rank{rank}.pt", weights_only=False)
        resume = torch.load(out / f"resume-rank{rank}.pt", weights_only=False)
        assert plain["steps"] == resume["steps"] == 3
        # step 1 from the checkpoint's history; steps 2 (the stalled one, sampled again) and 3 trained after the resume
        assert [h["step"] for h in resume["logs"]] == [h["step"] for h in plain["logs"]] == [1, 2, 3]
        for mine, theirs in zip(resume["logs"], plain["logs"]):
            assert {k: v for k, v in mine.items() if k != "train_runtime"} == {
                k: v for k, v in theirs.items() if k != "train_runtime"}, (mine, theirs)
        for name, w in plain["weights"].items():
            torch.testing.assert_close(resume["weights"][name], w, atol=0, rtol=0, msg=name)
