"""A real vLLM server that fails during training: stopped (not answering) mid-sync, killed mid-sync. Either way the
trainer ends within the bound with one line naming the server, what it was doing, the step and the cause, and no
process the launcher started is left behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from datasets import Dataset
from engines import MARKS, serve

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.vllm_launch import shared_memory_of_group
from grpokit.rollout.vllm_server import VLLMServerClient, VLLMServerError

pytestmark = MARKS


def trainer_on(url, tmp_path, timeout):
    tok = load_tokenizer("smollm2-135m-instruct")
    args = GRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=timeout, max_steps=3, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, learning_rate=1e-4, report_to="none", save_strategy="no",
                      gradient_checkpointing=False)
    return GRPOTrainer(model=load_model("smollm2-135m-instruct", dtype=torch.float32),
                       reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                       processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["Say hi."] * 16}))


def test_a_server_stopped_then_killed_mid_sync_ends_the_run_in_one_line(tmp_path, monkeypatch):
    with serve(tmp_path) as server:
        group = server.process.pid
        segments = shared_memory_of_group(group)
        assert segments and all(p.exists() for p in segments)  # vLLM's message queues
        load = VLLMServerClient.load_weight_file

        def stopped_at_step_1(client, path, n):  # the server stops answering as the step-1 sync reaches it
            if client.step == 1:
                os.killpg(group, signal.SIGSTOP)
            return load(client, path, n)

        monkeypatch.setattr(VLLMServerClient, "load_weight_file", stopped_at_step_1)
        trainer = trainer_on(server.url, tmp_path, timeout=10)
        start = time.monotonic()
        with pytest.raises(VLLMServerError) as e:
            trainer.train()
        assert time.monotonic() - start < 120  # steps 0 and 1 trained, then 10 s of waiting, not forever
        assert str(e.value).startswith(f"vLLM server at {server.url}: loading the weights (")
        assert "failed at training step 1: " in str(e.value) and "timed out" in str(e.value)
        assert "\n" not in str(e.value)

        os.killpg(group, signal.SIGCONT)  # the same run's next sync against a killed server
        os.killpg(group, signal.SIGKILL)
        server.process.wait()
        trainer.rollout.client.step = 2
        with pytest.raises(VLLMServerError, match=rf"vLLM server at {server.url}: loading the weights \(\d+ "
                                                  r"tensors\) failed at training step 2: .*(Connection|refused)"):
            trainer.rollout.sync_weights(trainer.model, step=2)
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in segments if p.exists()]  # the killed server's shared memory is removed too


def test_a_model_the_engine_cannot_load_is_one_line_from_its_own_log(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}')
    with pytest.raises(RuntimeError) as e:
        with serve(tmp_path, model=str(tmp_path / "not-a-model")):
            pass
    message = str(e.value)
    assert message.startswith("the vLLM server (") and "exited with status" in message and "\n" not in message
    assert "Error" in message.split("before answering: ", 1)[1]  # vLLM's own cause, not its "see above"
