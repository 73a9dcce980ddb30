"""Training with sharded weights: FSDP2 (accelerate's own wrapping, forced on for CPU, gloo) and DeepSpeed ZeRO-3
(DeepSpeed's CPU accelerator, gloo), two real processes each.

- training: two ranks × 4 rows equal one rank × 4 rows × GA 2 on the same rollouts (tolerance as in test_ddp);
- generation: transformers ``generate`` on sharded weights, with ``ds3_gather_for_generation`` True (weights
  gathered once) and False (lockstep on shards), gives exactly the completions of plain DDP, with the two ranks
  stopping at different lengths (without lockstep that mismatches the collectives and the run dies);
- the chunked log-prob head and the shared-prompt shortcuts are off under sharding (see grpokit/forward/sharding.py).
"""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from launch import LOSSES, TIMEOUT, accelerate_env, load, torchrun_ok, torchrun_several

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed not installed (pip install 'grpokit[test]')")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Real generation (seeded, 60 stop ids) under DDP, FSDP2 gathered, FSDP2 in lockstep, and DDP and FSDP2 with a
    LoRA adapter; FSDP2 configured by the shipped examples/accelerate/fsdp2.yaml. Two launches: the DDP runs, then
    the FSDP2 runs, each set made one after another by the same two processes."""
    root = tmp_path_factory.mktemp("sharded-real")
    torchrun_several([(root / "ddp", ["4", "1", "dapo", "--real-rollout"]),
                      (root / "ddp-lora", ["4", "1", "dapo", "--real-rollout", "--lora"])])
    example = accelerate_env("fsdp2")  # examples/accelerate/fsdp2.yaml, as accelerate launch applies it
    fsdp2 = ["4", "1", "dapo", "--real-rollout", "--shard", "fsdp2"]
    torchrun_several([(root / "fsdp2", fsdp2), (root / "fsdp2-lockstep", [*fsdp2, "--no-gather"]),
                      (root / "fsdp2-lora", [*fsdp2, "--lora"]), *saved_and_resumed(root / "fsdp2-checkpoint", "fsdp2")],
                     env=example)
    return root


def saved_and_resumed(root: Path, shard: str) -> list:
    """Two runs for :func:`test_sharded_checkpoint_resumes_bit_for_bit`, made after a fixture's other runs by the same
    two processes: AdamW (optimizer state to restore) saving after every step (``full/``), then a new trainer resumed
    from the first step's checkpoint on disk (``resumed/``), which trains step 2 only."""
    args = ["4", "1", "dapo", "--real-rollout", "--shard", shard, "--adamw"]
    return [(root / "full", [*args, "--save-steps"]),
            (root / "resumed", [*args, "--resume", str(root / "full" / "run-dapo" / "checkpoint-1")])]


def both_ranks(path, loss="dapo"):
    return [load(path / f"{loss}-rank{r}.pt") for r in (0, 1)]


def assert_same_run(ref, other, atol=0.0):
    for a, b in zip(ref, other):
        assert len(a["completions"]) == len(b["completions"]) == 2
        for ca, cb in zip(a["completions"], b["completions"]):
            assert torch.equal(ca, cb)
        for name, p in a["params"].items():
            torch.testing.assert_close(b["params"][name], p, atol=atol, rtol=0)


def test_the_ranks_stop_generating_at_different_lengths(real):
    r0, r1 = both_ranks(real / "ddp")
    widths = [(a.shape[1], b.shape[1]) for a, b in zip(r0["completions"], r1["completions"])]
    assert any(w0 != w1 for w0, w1 in widths), widths  # else lockstep would not be exercised


@pytest.mark.parametrize("run", ["fsdp2", "fsdp2-lockstep"])
def test_fsdp2_generates_and_trains_like_ddp(real, run):
    ref, fsdp = both_ranks(real / "ddp"), both_ranks(real / run)
    assert ref[0]["sharding"] is None and fsdp[0]["sharding"] == "fsdp2"
    plugin = fsdp[0]["fsdp_plugin"]  # from examples/accelerate/fsdp2.yaml
    assert plugin["fsdp_version"] == "2" and plugin["reshard_after_forward"] == "True"
    assert "FULL_STATE_DICT" in plugin["state_dict_type"]
    assert_same_run(ref, fsdp, atol=1e-6)


def test_fsdp2_with_lora_generates_and_trains_like_ddp(real):
    """LoRA under FSDP2: the adapter is merged into the gathered weights for generation (and unmerged before they
    are resharded); completions and parameters match DDP with the same adapter."""
    ref, fsdp = both_ranks(real / "ddp-lora"), both_ranks(real / "fsdp2-lora")
    assert fsdp[0]["sharding"] == "fsdp2" and any("lora_A" in n for n in fsdp[0]["params"])
    assert_same_run(ref, fsdp, atol=1e-6)


@pytest.fixture(scope="module")
def fsdp2_fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2-fake")
    torchrun_ok(root, "4", "1", ",".join(LOSSES), "--shard", "fsdp2")
    return root


def assert_equals_one_rank(one_rank, run, loss_type, sharding):
    """Both ranks' parameters equal one process with accumulation (tolerance as in test_ddp)."""
    one = load(one_rank / f"{loss_type}-rank0.pt")
    for rank in both_ranks(run, loss_type):
        assert rank["sharding"] == sharding
        for name, p in one["params"].items():
            torch.testing.assert_close(rank["params"][name], p, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_type", LOSSES)
def test_fsdp2_two_ranks_equal_one_rank_with_accumulation(fsdp2_fake, one_rank, loss_type):
    assert_equals_one_rank(one_rank, fsdp2_fake, loss_type, "fsdp2")


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """ZeRO-3 with real generation (dapo), with the fake rollouts (three losses), and a checkpoint saved and resumed
    (:func:`saved_and_resumed`), one launch."""
    root = tmp_path_factory.mktemp("zero3")
    torchrun_several([(root / "real", ["4", "1", "dapo", "--real-rollout", "--shard", "zero3"]),
                      (root / "fake", ["4", "1", ",".join(LOSSES), "--shard", "zero3"]),
                      *saved_and_resumed(root / "zero3-checkpoint", "zero3")])
    return root


@needs_deepspeed
def test_zero3_generates_and_trains_like_ddp(real, zero3):
    run = both_ranks(zero3 / "real")
    assert run[0]["sharding"] == "zero3"
    assert_same_run(both_ranks(real / "ddp"), run, atol=1e-6)


@needs_deepspeed
def test_zero3_two_ranks_equal_one_rank_with_accumulation(one_rank, zero3):
    for loss_type in LOSSES:
        assert_equals_one_rank(one_rank, zero3 / "fake", loss_type, "zero3")


@pytest.mark.parametrize("config", ["torchrun", pytest.param("zero2", marks=needs_deepspeed),
                                    pytest.param("zero3", marks=needs_deepspeed)])
def test_the_cli_job_under_a_launcher(tmp_path, tiny_dir, config):
    """`torchrun -m grpokit.cli train` (DDP on gloo), and `accelerate launch` with examples/accelerate/zero2.yaml and
    zero3.yaml as shipped (only the process count and mixed precision changed on the command line for a 2-core
    CPU): the job evaluates, trains 2 steps, saves a whole model and writes one report."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    job = tmp_path / "job.yaml"
    out = tmp_path / "out"
    job.write_text(f"""loss_type: dapo
model: {tiny_dir}
task: arithmetic
reward_funcs: ["distinct_chars:reward"]
output_dir: {out}
per_device_train_batch_size: 4
num_generations: 4
max_completion_length: 8
generation_kwargs: {{eos_token_id: {list(range(100, 160))}}}
learning_rate: 0.05
optim: sgd
max_steps: 2
logging_steps: 1
save_strategy: "no"
report_to: none
use_cpu: true
eval: {{n: 4, max_new_tokens: 8}}
""")
    (tmp_path / "distinct_chars.py").write_text(
        "def reward(completions, **kw):\n    return [len(c[0]['content']) / 8.0 for c in completions]\n")
    root = Path(__file__).resolve().parents[2]
    if config == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(root / "examples" / "accelerate" / f"{config}.yaml"), "--num_processes", "2",
                    "--mixed_precision", "no"]
    if config == "torchrun":
        cmd = [*launcher, "-m", "grpokit.cli", "train", str(job), "--quiet"]
    else:  # the same module, DeepSpeed's inference-only C++ build skipped (deepspeed_cpu.py)
        cmd = [*launcher, str(Path(__file__).with_name("deepspeed_cpu.py")), "-m", "grpokit.cli", "train", str(job),
               "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("report: ") == 1  # one rank prints and writes
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["steps"] == 2
    trained = load_file(out / "final" / "model.safetensors")
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    assert all(trained[k].shape == initial[k].shape for k in trained)  # whole tensors, not ZeRO-3 partitions
    expected = {"num_processes": 2, "type": "MULTI_CPU", "zero_stage": None, "sharding": None}
    if config != "torchrun":
        expected.update(type="DEEPSPEED", zero_stage=int(config[-1]), sharding="zero3" if config == "zero3" else None)
    assert report["extra"]["distributed"] == expected
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # and trained


@pytest.mark.parametrize("shard", ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_sharded_checkpoint_resumes_bit_for_bit(request, shard):
    """A checkpoint written by two sharded ranks (FSDP2: accelerate's sharded optimizer state and full model state
    dict; ZeRO-3: DeepSpeed's engine checkpoint) resumes to the same parameters as the uninterrupted run, with AdamW
    so there is optimizer state to restore. Tolerance 0. Both runs are made by the fixture's launch
    (:func:`saved_and_resumed`); the resumed one starts from a new trainer and the checkpoint on disk, with what the
    runs before it left in the processes' random generators."""
    root = request.getfixturevalue("real" if shard == "fsdp2" else "zero3") / f"{shard}-checkpoint"
    checkpoint = root / "full" / "run-dapo" / "checkpoint-1"
    assert checkpoint.is_dir() and not list((root / "full" / "run-dapo").glob("*.tmp-*"))
    for full, resumed in zip(both_ranks(root / "full"), both_ranks(root / "resumed")):
        assert resumed["sharding"] == shard
        assert len(full["completions"]) == 2 and len(resumed["completions"]) == 1  # it ran step 2 only
        assert torch.equal(resumed["completions"][0], full["completions"][1])
        for name, p in full["params"].items():
            assert torch.equal(resumed["params"][name], p), name
