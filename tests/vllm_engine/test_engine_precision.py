"""``rollout_precision`` with vLLM's own server (vLLM's CPU build): ``grpokit vllm-serve --rollout-precision int8``
serves 8-bit weights (vLLM's ``fp8_per_channel``); a trainer asking for another precision is refused in one line;
a trainer asking for ``int8`` trains through it with the mismatch measured, and full weight syncs reach the quantised
engine (its weights are quantised again as they load)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from engines import MARKS, VLLM_PYTHON, serve
from test_engine import PROMPTS, distinct_tokens, train

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.fp8_kernel import fp8_matmul_kernel
from grpokit.rollout.vllm_launch import free_port
from grpokit.rollout.vllm_server import VLLMServerError

pytestmark = MARKS


@pytest.fixture(scope="module")
def fp8_kernel():
    """The oneDNN kernel vLLM's environment multiplies the 8-bit weights on (None: not oneDNN's)."""
    return fp8_matmul_kernel(str(VLLM_PYTHON))


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory, fp8_kernel):
    if fp8_kernel is not None and fp8_kernel.startswith("ref"):
        pytest.skip(f"vLLM's 8-bit products run on oneDNN's reference loop on this CPU ({fp8_kernel}), where grpokit "
                    "refuses rollout_precision='int8' for vLLM (the test below)")
    with serve(tmp_path_factory.mktemp("vllm-int8"), rollout_precision="int8", enable_lora=False) as server:
        yield server


def test_int8_is_refused_in_one_line_where_the_engine_would_multiply_on_onednns_reference_loop(fp8_kernel):
    """Through the command users run, against the vLLM environment's own torch: where its fp8 product is oneDNN's
    reference loop (a 2-core Xeon with AVX512-FP16: vLLM made about a token a minute), ``grpokit vllm-serve
    --rollout-precision int8`` exits with one line and starts no server."""
    if fp8_kernel is None or not fp8_kernel.startswith("ref"):
        pytest.skip(f"vLLM's 8-bit products do not run on oneDNN's reference loop here ({fp8_kernel}): int8 is served")
    cmd = [sys.executable, "-m", "grpokit.cli", "vllm-serve", "--model", "smollm2-135m-instruct", "--port",
           str(free_port()), "--rollout-precision", "int8", "--python", str(VLLM_PYTHON)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a hang guard (the probe takes seconds)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith("grpokit: error: rollout_precision='int8' is not allowed with vLLM on this CPU: use "
                             "'bf16' or 'auto'") and fp8_kernel in err[0]
    assert "Starting vLLM" not in done.stdout + done.stderr


def mean_gap(client, model, ids: list[int]) -> float:
    served = torch.tensor(client.prompt_logprobs(ids))
    with torch.no_grad():
        logps = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return float((served - logps.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)).abs().mean())


def test_a_trainer_asking_another_precision_is_refused_in_one_line(int8_engine, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_base_url=int8_engine.url,
                      rollout_precision="bf16", per_device_train_batch_size=4, num_generations=4, report_to="none")
    with pytest.raises(VLLMServerError) as e:
        GRPOTrainer(model=load_model("smollm2-135m-instruct", dtype=torch.float32), reward_funcs=distinct_tokens,
                    args=args, processing_class=load_tokenizer("smollm2-135m-instruct"),
                    train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert "rollout_precision='bf16' is not allowed with the vLLM server" in str(e.value)
    assert "quantization fp8_per_channel" in str(e.value) and "\n" not in str(e.value)


def test_int8_trains_through_the_quantised_engine_and_syncs_reach_it(int8_engine, tmp_path, monkeypatch):
    trainer, gaps, syncs, moved, trainable = train(int8_engine, tmp_path, monkeypatch, steps=2, record=False,
                                                   rollout_precision="int8")
    assert {s.kind for s in syncs} == {"full"} and len(moved) >= 0.9 * trainable
    logs = [h for h in trainer.state.log_history if "sampling/mismatch_kl_k3" in h]
    assert logs and all(float(h["sampling/mismatch_kl_k3"]) > 0 for h in logs)  # 8-bit weights: a mismatch
    tok = load_tokenizer("smollm2-135m-instruct")
    fixed = tok("The capital of France is Paris, and the capital of Italy is Rome.").input_ids
    floor = mean_gap(trainer.rollout.client, trainer.model, fixed)  # the 8-bit weights' own gap
    with torch.no_grad():  # another model, as natural as the first: the sentence's token embeddings swapped
        emb = trainer.model.get_input_embeddings().weight
        ids = torch.tensor(sorted(set(fixed)))
        emb[ids], emb[ids + 1000] = emb[ids + 1000].clone(), emb[ids].clone()
    stale = mean_gap(trainer.rollout.client, trainer.model, fixed)
    trainer.rollout.sync_weights(trainer.model, step=99)
    synced = mean_gap(trainer.rollout.client, trainer.model, fixed)
    # measured: floor 0.14, stale 10.3, synced 0.44 (the swapped model's own 8-bit gap; 0.25-0.38 by hand)
    assert floor < 1.0 and synced < 1.0 and stale > 10 * synced, (floor, stale, synced)
