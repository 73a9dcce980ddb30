"""Two real processes (torchrun, gloo on CPU) against one process with gradient accumulation on the same rollouts.

Tolerance: parameters agree to 1e-5 absolute / 1e-4 relative after two SGD steps (lr 0.5): the ranks sum the
same terms in a different order and all-reduce them, which moves float32 results by ~1e-7 relative.
"""

import shutil

import pytest
import torch
from launch import LOSSES, load, torchrun, torchrun_several

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_rank):
    """One launch of two ranks making, one after another: 4 rows each for three losses (against one rank × 4 rows ×
    GA 2, the same 8-row generation batches); 2 rows each with G = 4, every group split across the ranks (against
    one rank × 2 rows × GA 2); 4 rows each with ``top_entropy_quantile`` 0.3 (against one rank × 8 rows). The
    one-rank references come from the ``one_rank`` fixture. And a tiny Mixture-of-Experts policy with routing replay
    on both ranks, and a run with a rollout worker process on each rank."""
    root = tmp_path_factory.mktemp("ddp")
    torchrun_several([(root / "two", ["4", "1", ",".join(LOSSES)]), (root / "split2", ["2", "1", "dapo"]),
                      (root / "top-entropy", ["4", "1", "dapo", "--top-entropy", "0.3"]),
                      (root / "moe", ["4", "1", "dapo", "--moe"]), (root / "workers", ["4", "1", "dapo", "--workers"])])
    (root / "one").symlink_to(one_rank)
    (root / "split1").symlink_to(one_rank / "split")
    return root


@pytest.mark.parametrize("loss_type", LOSSES)
def test_two_ranks_equal_one_rank_with_accumulation(runs, loss_type):
    one = load(runs / "one" / f"{loss_type}-rank0.pt")
    r0 = load(runs / "two" / f"{loss_type}-rank0.pt")
    r1 = load(runs / "two" / f"{loss_type}-rank1.pt")
    initial = None
    for name, p in one["params"].items():
        torch.testing.assert_close(r0["params"][name], p, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r1["params"][name], r0["params"][name], atol=0, rtol=0)  # DDP keeps ranks equal
    from tiny import tiny_model, tiny_tokenizer

    initial = tiny_model(tiny_tokenizer(), seed=7).state_dict()
    moved = max((one["params"][n] - initial[n]).abs().max().item() for n in one["params"])
    assert moved > 1e-3  # training happened
    # Advantages of each generation batch: rank 0 holds the first half, rank 1 the second.
    for a_one, a0, a1 in zip(one["advantages"], r0["advantages"], r1["advantages"]):
        torch.testing.assert_close(torch.cat([a0, a1]), a_one, atol=1e-6, rtol=1e-6)


def test_group_split_across_ranks_gets_the_same_advantages(runs):
    one = load(runs / "split1" / "dapo-rank0.pt")
    r0 = load(runs / "split2" / "dapo-rank0.pt")
    r1 = load(runs / "split2" / "dapo-rank1.pt")
    assert len(one["advantages"]) == 2 and all(a.numel() == 4 for a in one["advantages"])
    assert all(a.numel() == 2 for a in r0["advantages"])  # each rank holds half of the one group
    for a_one, a0, a1 in zip(one["advantages"], r0["advantages"], r1["advantages"]):
        assert a_one.abs().sum() > 0
        torch.testing.assert_close(torch.cat([a0, a1]), a_one, atol=1e-6, rtol=1e-6)
    for name, p in one["params"].items():
        torch.testing.assert_close(r0["params"][name], p, atol=1e-5, rtol=1e-4)


def test_metrics_are_reduced_across_ranks(runs):
    r0 = load(runs / "two" / "dapo-rank0.pt")
    one = load(runs / "one" / "dapo-rank0.pt")
    logs0 = [h for h in r0["logs"] if "reward" in h]
    logs1 = [h for h in one["logs"] if "reward" in h]
    for a, b in zip(logs0, logs1):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
        assert a["completions/mean_length"] == pytest.approx(b["completions/mean_length"])
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4)  # a loss metric, averaged over ranks


def test_a_failing_rank_ends_the_run_with_its_error(tmp_path):
    r = torchrun(tmp_path, "4", "1", "dapo", "--fail-rank", "1")
    assert r.returncode != 0
    assert "deliberate failure on rank 1" in (r.stdout + r.stderr)


def test_entropy_mask_threshold_is_the_whole_batch_quantile(runs):
    """top_entropy_quantile under DDP: the threshold is the quantile of every rank's entropies (as TRL gathers
    them), so two ranks × 4 rows train exactly like one rank × 8 rows in one micro-batch; with each rank's own
    quantile they would not."""
    one = load(runs / "one" / "top-entropy" / "dapo-rank0.pt")
    for rank in (0, 1):
        two = load(runs / "top-entropy" / f"dapo-rank{rank}.pt")
        for name, p in one["params"].items():
            torch.testing.assert_close(two["params"][name], p, atol=1e-5, rtol=1e-4)


def test_routing_replay_on_two_ranks(runs):
    """Each rank forces the experts its own sampler recorded for its own rows (none differs, though the router alone
    would have re-routed some), the router metrics are logged, and DDP keeps the weights equal on both ranks."""
    ranks = [load(runs / "moe" / f"dapo-rank{r}.pt") for r in (0, 1)]
    for rank in ranks:
        assert rank["moe"]["taps"] == 2 and rank["moe"]["violations"] == 0 and rank["moe"]["rerouted"] > 0
        assert all("moe/rerouted_share" in h for h in rank["logs"] if "reward" in h)
    for name, p in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], p, atol=0, rtol=0)


def test_rollout_workers_on_two_ranks(runs):
    """Each rank's worker samples that rank's own rows: every rank trains on distinct prompts at every step, and the
    weights are equal on both ranks after every step (each rank publishes its own to its own worker)."""
    ranks = [load(runs / "workers" / f"dapo-rank{r}.pt") for r in (0, 1)]
    assert len(ranks[0]["prompts"]) == len(ranks[1]["prompts"]) == 2
    for mine, theirs in zip(ranks[0]["prompts"], ranks[1]["prompts"]):
        assert len(mine) == len(theirs) == 4 and not set(mine) & set(theirs)
    assert len(ranks[0]["checksums"]) == 2 and ranks[0]["checksums"] == ranks[1]["checksums"]
    assert all("sample/staleness_max" in h for h in ranks[0]["logs"] if "reward" in h)
    for name, p in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], p, atol=0, rtol=0)
