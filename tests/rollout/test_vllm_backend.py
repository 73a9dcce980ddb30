"""The vLLM backend against fake engines with vLLM's and TRL-client's interfaces (CPU; the real engine runs in
benchmarks/gpu_check.sh on a GPU machine)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from runs import first_loss_inputs
from tiny import tiny_model, tiny_tokenizer

from grpokit.algorithms import sampler_importance_ratio
from grpokit.config import GRPOConfig
from grpokit.forward.logprobs import completion_logps
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.vllm_backend import VLLMRollout, engine_weights, vllm_sampling_kwargs
from grpokit.trainer import GRPOTrainer


class FakeEngineModel:
    def __init__(self, events=None):
        self.loaded = []
        self.events = events

    def load_weights(self, weights):
        self.loaded.append({k: v.clone() for k, v in weights})
        if self.events is not None:
            self.events.append("load")


class FakeLLM:
    """vllm.LLM's surface as the backend uses it: generate() → outputs[0].token_ids/.logprobs/.finish_reason."""

    def __init__(self, tokenizer, seed=0):
        self.tok = tokenizer
        self.gen = torch.Generator().manual_seed(seed)
        self.events = []
        self.engine_model = FakeEngineModel(self.events)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.engine_model))))
        self.resets = 0
        self.calls = []
        self.outputs = []

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append((prompts, sampling_params))
        self.events.append("generate")
        outs = []
        for i, _ in enumerate(prompts):
            n = int(torch.randint(1, sampling_params["max_tokens"] + 1, (1,), generator=self.gen))
            ids = torch.randint(10, len(self.tok), (n,), generator=self.gen).tolist()
            finished = i % 2 == 0 and n < sampling_params["max_tokens"]
            if finished:
                ids[-1] = self.tok.eos_token_id
            lps = (-torch.rand(n, generator=self.gen) * 4).tolist()
            logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=ids, logprobs=logprobs, finish_reason="stop" if finished else "length")]))
        self.outputs.append(outs)
        return outs

    def reset_prefix_cache(self):
        self.resets += 1
        self.events.append("reset")

    def sleep(self, level):
        self.events.append(f"sleep{level}")

    def wake_up(self):
        self.events.append("wake")


class FakeClient:
    """TRL's VLLMClient surface (server mode)."""

    def __init__(self):
        self.params, self.resets, self.requests = {}, 0, []

    def generate(self, prompts, n=1, generation_kwargs=None, **kw):
        self.requests.append((prompts, kw, generation_kwargs))
        comp = [[11, 12, 2][: 1 + i % 3] for i in range(len(prompts))]
        return {"completion_ids": comp, "logprobs": [[[-0.5] for _ in c] for c in comp]}

    def update_named_param(self, name, tensor):
        self.params[name] = tensor.clone()

    def reset_prefix_cache(self):
        self.resets += 1


def args_for(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_vllm=True, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", gradient_checkpointing=False, learning_rate=1e-2, disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def test_sampling_kwargs_in_vllm_terms():
    kw = vllm_sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, top_k=0, min_p=None,
                                             extra={"seed": 3}))
    assert kw == dict(n=1, temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=7,
                      logprobs=0, seed=3)


def test_colocate_generate_returns_padded_rows_and_sampler_logps(tmp_path):
    tok = tiny_tokenizer()
    llm = FakeLLM(tok)
    backend = VLLMRollout("unused", tok, args_for(tmp_path), llm=llm, sampling_params_cls=dict)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = backend.generate(None, ids, mask, SamplingParams(max_new_tokens=6))
    prompts, _ = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9, 10]}]  # padding stripped
    assert out.completion_ids.shape == out.sampler_logps.shape == out.completion_mask.shape
    assert ((out.sampler_logps != 0) == out.completion_mask.bool()).all()
    expected = [o.outputs[0].finish_reason == "length" for o in llm.outputs[0]]
    assert out.is_truncated.tolist() == expected
    assert out.is_truncated[1]  # odd rows never end on EOS in the fake
    lengths = [len(o.outputs[0].token_ids) for o in llm.outputs[0]]
    assert out.completion_mask.sum(1).tolist() == lengths


def test_server_mode_uses_the_client(tmp_path):
    tok = tiny_tokenizer()
    client = FakeClient()
    backend = VLLMRollout("unused", tok, args_for(tmp_path, vllm_mode="server"), client=client)
    out = backend.generate(None, torch.tensor([[3, 4]] * 3), torch.ones(3, 2, dtype=torch.long),
                           SamplingParams(max_new_tokens=3, extra={"seed": 1}))
    prompts, kw, extra = client.requests[0]
    assert prompts == [[3, 4]] * 3 and kw["max_tokens"] == 3 and kw["logprobs"] == 0 and extra == {"seed": 1}
    assert out.completion_mask.sum(1).tolist() == [1, 2, 3]
    assert out.is_truncated.tolist() == [False, False, False]  # row 2 ended on EOS (id 2) at the limit
    model = tiny_model(tok)
    backend.sync_weights(model)
    assert set(client.params) == set(model.state_dict()) and client.resets == 1


@pytest.mark.parametrize("loss_type,mode", [("dapo", "sequence_mask"), ("vespo", "token_truncate"),
                                            ("grpo", "token_mask")])
def test_trainer_with_colocated_engine_corrects_and_syncs(tmp_path, loss_type, mode):
    tok = tiny_tokenizer()
    llm = FakeLLM(tok)
    args = args_for(tmp_path, loss_type=loss_type, vllm_importance_sampling_mode=mode)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(8)]})
    model = tiny_model(tok)
    backend = VLLMRollout("unused", tok, args, llm=llm, sampling_params_cls=dict)
    trainer = GRPOTrainer(model, lambda completions, **k: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=ds, processing_class=tok, rollout_backend=backend)
    from transformers import TrainerCallback

    after_step_1 = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                after_step_1.update({k: v.clone() for k, v in model.state_dict().items()})

    trainer.add_callback(Snapshot())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    first_policy = copy.deepcopy(model)
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    batch = seen["batch"]  # the first micro-batch the loss took, on-policy: its own forward is the trainer's
    assert batch.old_logps is None and batch.sampler_logps is not None
    with torch.no_grad():
        trainer_logps, _ = completion_logps(first_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                            batch.completion_mask, compute_entropy=False)
    expected = sampler_importance_ratio(trainer_logps, batch.sampler_logps, batch.completion_mask.float(), mode, None,
                                        3.0)
    assert seen["sampler_ratio"].shape[-1] == (1 if mode.startswith("sequence") else batch.completion_ids.shape[1])
    torch.testing.assert_close(seen["sampler_ratio"], expected)
    assert not torch.allclose(expected, torch.ones_like(expected))  # the fake engine is not the trainer
    assert len(llm.engine_model.loaded) == 1 and llm.resets == 1  # synced before the second generation
    loaded = llm.engine_model.loaded[0]
    assert any(not torch.equal(loaded[n], initial[n]) for n in initial)
    for name, p in after_step_1.items():
        torch.testing.assert_close(loaded[name], p)  # the engine got the weights of the first update


@pytest.mark.parametrize("sleep", [False, True])
def test_sleep_mode_frees_the_engine_between_generations(tmp_path, sleep):
    """vllm_enable_sleep_mode: the colocated engine sleeps (level 1: weights to CPU, KV cache freed) after each
    generation and wakes before the next weight push or generation."""
    tok = tiny_tokenizer()
    llm = FakeLLM(tok)
    args = args_for(tmp_path, vllm_enable_sleep_mode=sleep)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(8)]})
    backend = VLLMRollout("unused", tok, args, llm=llm, sampling_params_cls=dict)
    trainer = GRPOTrainer(tiny_model(tok), lambda completions, **k: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=ds, processing_class=tok, rollout_backend=backend)
    trainer.train()
    if sleep:
        assert llm.events == ["generate", "sleep1", "wake", "load", "reset", "generate", "sleep1"]
    else:
        assert llm.events == ["generate", "load", "reset", "generate"]


def test_lora_weights_are_merged_for_the_engine():
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    base_state = {k: v.clone() for k, v in tiny_model(tok).state_dict().items()}
    peft_model = get_peft_model(tiny_model(tok), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                            init_lora_weights=False))
    with engine_weights(peft_model) as pairs:
        weights = {k: v.clone() for k, v in pairs}
    assert set(weights) == set(base_state)  # plain model names: no lora_, base_layer or prefixes
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(weights[q], base_state[q])  # the adapter is merged in
    torch.testing.assert_close(weights["model.layers.0.self_attn.k_proj.weight"],
                               base_state["model.layers.0.self_attn.k_proj.weight"])
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(layer.base_layer.weight, base_state[q])  # the base weight is never touched
    assert not layer.merged
    peft_model.merge_adapter()  # what the engine gets is what PEFT's own merge gives
    torch.testing.assert_close(weights[q], layer.base_layer.weight)


def test_engine_weights_leave_a_bf16_base_as_it_was():
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    model = get_peft_model(tiny_model(tok).to(torch.bfloat16), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                                          init_lora_weights=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(5):
        with engine_weights(model) as pairs:
            weights = dict(pairs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_vespo_rejects_a_sequence_level_sampler_mode(tmp_path):
    with pytest.raises(ValueError, match="vespo"):
        args_for(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="sequence_truncate")


class RpcLLM(FakeLLM):
    """vLLM 0.32's ``LLM`` as the colocated weight sync uses it: ``collective_rpc`` runs a method of the worker
    extension on every worker (here one, holding its own copy of the model: grpokit's real
    :class:`WeightFileLoader` mixed into a worker whose runner reloads weights by name), and no
    ``llm_engine.model_executor.driver_worker`` (vLLM V1's multiprocess engine has none)."""

    def __init__(self, tokenizer, engine_model):
        super().__init__(tokenizer)
        del self.llm_engine
        from grpokit.rollout.vllm_worker import WeightFileLoader

        def reload_weights(weights_iterator):
            engine_model.load_state_dict(dict(weights_iterator), strict=False)
            self.events.append("load")

        class Worker(WeightFileLoader):
            model_runner = SimpleNamespace(reload_weights=reload_weights, model=engine_model)

        self.worker = Worker()

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]


def test_a_colocated_engine_loads_the_trainers_weights_through_its_workers(tmp_path):
    from transformers import TrainerCallback

    tok = tiny_tokenizer()
    model, engine_copy = tiny_model(tok), tiny_model(tok)
    initial = {k: v.clone() for k, v in engine_copy.state_dict().items()}
    llm = RpcLLM(tok, engine_copy)
    args = args_for(tmp_path)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(8)]})
    backend = VLLMRollout("unused", tok, args, llm=llm, sampling_params_cls=dict)
    trainer = GRPOTrainer(model, lambda completions, **k: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=ds, processing_class=tok, rollout_backend=backend)
    after_step_1 = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                after_step_1.update({k: v.clone() for k, v in model.state_dict().items()})

    trainer.add_callback(Snapshot())
    trainer.train()
    assert llm.events == ["generate", "load", "reset", "generate"]  # synced before the second generation
    assert backend.sync.last.kind == "full" and backend.sync.last.bytes > 0
    engine = engine_copy.state_dict()
    assert any(not torch.equal(engine[n], initial[n]) for n in engine)
    for name, p in after_step_1.items():
        torch.testing.assert_close(engine[name], p)  # every weight of the first update, through the file
    assert not list(backend.sync._dir.iterdir())  # the weight file was removed once read
