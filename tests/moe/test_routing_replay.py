"""Routing replay through ``GRPOTrainer`` on tiny random Mixture-of-Experts models of every family it covers.

The sampler here routes differently from the trainer on purpose (``tiny_moe.ShiftedRouters``: generation runs with
every router's weights perturbed, as a lower-precision engine's routing drifts), so a replay that did not happen would show:
with ``routing_replay="rollout"`` every recorded token of the training forward uses exactly the recorded experts, and
with ``"none"`` some do not."""

from __future__ import annotations

import os

import pytest
import torch
from runs import chat_dataset, make_args, params_of, train_logs, varied_reward
from tiny import tiny_model, tiny_tokenizer
from tiny_moe import FAMILIES, ShiftedRouters, tiny_moe_model

import grpokit.moe.training as moe_training
from grpokit.moe import RouteTap
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.trainer import GRPOTrainer


@pytest.fixture
def taps(monkeypatch):
    """Every training forward's tap, kept when it closes: (forced (N·T, L, k) or None, used [L × (N·T, k)],
    differs [L × (N·T,)] or None)."""
    seen = []

    class Kept(RouteTap):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            seen.append((self.forced, list(self.used), list(self.differs)))

    monkeypatch.setattr(moe_training, "RouteTap", Kept)
    return seen


def train(tmp_path, family="qwen3_moe", mode="rollout", shifted=True, model=None, **kw):
    tok = tiny_tokenizer()
    model = model if model is not None else tiny_moe_model(family, tok)
    trainer = GRPOTrainer(model, varied_reward, args=make_args(tmp_path, routing_replay=mode, **kw),
                          train_dataset=chat_dataset(), processing_class=tok,
                          rollout_backend=ShiftedRouters(tok) if shifted else None)
    trainer.train()
    return trainer


def replayed_exactly(taps) -> int:
    """Asserts that every recorded token used its recorded experts in every layer; returns how many tokens the
    router alone would have sent elsewhere (so the replay mattered)."""
    flips = 0
    for forced, used, differs in taps:
        assert forced is not None
        recorded = (forced != 255).all(-1).all(-1)
        assert recorded.sum() > 0
        for layer, experts in enumerate(used):
            want = forced[recorded, layer].long().sort(-1).values
            assert torch.equal(experts[recorded].long().sort(-1).values, want)
        flips += int(torch.stack(differs, 1)[recorded].any(1).sum())
    return flips


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_replay_forces_the_sampled_experts(tmp_path, taps, family):
    trainer = train(tmp_path, family, "rollout")
    assert len(taps) == 2 and replayed_exactly(taps) > 0
    logs = train_logs(trainer)
    assert all(h["moe/rerouted_share"] > 0 and h["moe/load_imbalance"] >= 1 for h in logs)
    assert all(f"moe/rerouted_share/layer_{i:02d}" in h for h in logs for i in (0, 1))


def test_without_replay_the_router_chooses_for_itself(tmp_path, taps):
    train(tmp_path, "qwen3_moe", "none")
    assert len(taps) == 2 and all(forced is None for forced, _, _ in taps)
    assert sum(int(torch.stack(d, 1).any(1).sum()) for _, _, d in taps) > 0  # the sampler's experts were not used


def test_old_replay_forces_the_old_forwards_experts(tmp_path, taps):
    """``num_iterations=2``: the second pass over a batch forces what the old log-probs' forward used (recorded by
    the learner), while its own router, one optimizer step later, would choose otherwise."""
    train(tmp_path, "qwen3_moe", "old", shifted=False, num_iterations=2, learning_rate=0.05, max_steps=4)
    replayed_exactly(taps)
    assert sum(int(torch.stack(d, 1).any(1).sum()) for f, _, d in taps) > 0


def test_replay_of_unchanged_routes_trains_exactly_as_without(tmp_path):
    """On-policy with grpokit's own sampler the recorded experts are the router's own: the same weights come out."""
    tok = tiny_tokenizer()
    plain = train(tmp_path / "none", mode="none", shifted=False, model=tiny_moe_model("qwen3_moe", tok))
    replay = train(tmp_path / "rollout", mode="rollout", shifted=False, model=tiny_moe_model("qwen3_moe", tok))
    for name, value in params_of(plain.model).items():
        torch.testing.assert_close(params_of(replay.model)[name], value, rtol=0, atol=1e-6)


def test_the_router_learns_through_replayed_gate_weights(tmp_path):
    """With the load-balancing loss off, the router's only gradient is through the forced experts' gate weights."""
    model = tiny_moe_model("qwen3_moe")
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    trainer = train(tmp_path, model=model, router_aux_loss_coef=0.0)
    assert trainer.router_aux_loss_coef == 0.0 and len(routers) == 2
    assert all(not torch.equal(model.get_parameter(n), before) for n, before in routers.items())


@pytest.mark.parametrize("setting", ["lora", "gradient_checkpointing", "async", "old_async"])
def test_replay_holds_with(tmp_path, taps, setting):
    kw, peft = {}, None
    if setting == "lora":
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    elif setting == "gradient_checkpointing":
        kw["gradient_checkpointing"] = True
    elif setting == "async":
        kw.update(max_staleness=1, max_steps=3)
    mode = "old" if setting == "old_async" else "rollout"
    if setting == "old_async":
        kw.update(max_staleness=1, max_steps=3)
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_moe_model("qwen3_moe", tok), varied_reward,
                          args=make_args(tmp_path, routing_replay=mode, **kw), train_dataset=chat_dataset(),
                          processing_class=tok, rollout_backend=ShiftedRouters(tok), peft_config=peft)
    trainer.train()
    flips = replayed_exactly(taps)
    if mode == "rollout":
        assert flips > 0
    logs = train_logs(trainer)
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_resume_replays_the_same_routes(tmp_path, taps):
    """A checkpoint inside a generation batch holds its unconsumed micro-batches with their recordings: the resumed
    run forces the experts the uninterrupted one did."""
    kw = dict(steps_per_generation=2, max_steps=4, save_strategy="steps", save_steps=1)
    train(tmp_path, **kw)
    whole = [forced for forced, _, _ in taps]
    taps.clear()
    resumed = GRPOTrainer(tiny_moe_model("qwen3_moe", tiny_tokenizer()), varied_reward,
                          args=make_args(tmp_path, routing_replay="rollout", **kw), train_dataset=chat_dataset(),
                          processing_class=tiny_tokenizer(), rollout_backend=ShiftedRouters(tiny_tokenizer()))
    resumed.train(resume_from_checkpoint=os.path.join(resumed.args.output_dir, "checkpoint-1"))
    again = [forced for forced, _, _ in taps]
    assert len(whole) == 4 and len(again) == 3
    for a, b in zip(whole[1:], again):
        assert torch.equal(a, b)


def test_routing_replay_on_a_dense_model_is_refused(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^routing_replay='old' is not allowed: LlamaForCausalLM is not a "
                                         r"Mixture-of-Experts model with routers grpokit recognises; leave it 'none'$"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, routing_replay="old"),
                    train_dataset=chat_dataset(), processing_class=tok)


def test_rollout_replay_needs_a_sampler_that_records(tmp_path):
    tok = tiny_tokenizer()

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[5, 6]] * len(prompts),
                "logprobs": [[-1.0, -1.0]] * len(prompts)}

    with pytest.raises(ValueError, match=r"^routing_replay='rollout' is not allowed with a rollout_func: it does not "
                                         r"record the experts it routes to; use routing_replay='old'$"):
        GRPOTrainer(tiny_moe_model("qwen3_moe", tok), varied_reward,
                    args=make_args(tmp_path, routing_replay="rollout"), train_dataset=chat_dataset(),
                    processing_class=tok, rollout_func=rollout_func)


def test_routing_replay_is_a_yaml_key_with_its_choices():
    from grpokit.config import GRPOConfig
    from grpokit.run.job_spec import split_spec

    assert split_spec({"model": "m", "task": "word_count", "routing_replay": "rollout"})[1] == {"routing_replay": "rollout"}
    with pytest.raises(ValueError, match=r"^routing_replay='R3' is not allowed: use one of 'none', 'old', 'rollout'$"):
        GRPOConfig(output_dir="unused", routing_replay="R3")


def test_rollout_replay_routes_the_old_pass_alike(tmp_path):
    """With a batch reused across optimizer steps, the old log-probs' forward forces the sampler's experts too: on
    the first step of a batch the policy ratio is exactly 1 on every token, re-routed ones included (left to its own
    router, the old pass would route those tokens otherwise and their ratio would not be 1)."""
    trainer = train(tmp_path, steps_per_generation=2, max_steps=4)
    fresh = [h for h in trainer.state.log_history if "reward" in h]  # the steps that sampled a batch
    assert len(fresh) == 2
    assert all(h["moe/rerouted_any_layer"] > 0 and h["moe/policy_ratio_std/rerouted"] < 1e-6 for h in fresh)


def test_rollout_replay_with_vllm_is_refused_in_one_line(tmp_path, monkeypatch):
    from grpokit.rollout.vllm_backend import VLLMRollout

    monkeypatch.setattr(VLLMRollout, "_make_client", staticmethod(lambda args, model_name_or_path: object()))
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^routing_replay='rollout' is not allowed with use_vllm=True \(grpokit does "
                                         r"not ask vLLM for the experts it routes to yet\): .*use routing_replay='old'$"):
        GRPOTrainer(tiny_moe_model("qwen3_moe", tok), varied_reward,
                    args=make_args(tmp_path, routing_replay="rollout", use_vllm=True, vllm_mode="server"),
                    train_dataset=chat_dataset(), processing_class=tok)


def test_a_family_whose_gate_is_not_recognised(tmp_path):
    """DeepSeek-V3's router (group-limited top-k with a score bias) is not one grpokit can replay: refused by name with
    ``routing_replay`` set; without it the run is made, with no router metrics."""
    import transformers

    tok = tiny_tokenizer()
    cfg = transformers.DeepseekV3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=128, eos_token_id=tok.eos_token_id)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate \(DeepseekV3TopkRouter\) is a Mixture-of-"
                                         r"Experts router whose gate grpokit does not recognise"):
        GRPOTrainer(transformers.AutoModelForCausalLM.from_config(cfg), varied_reward,
                    args=make_args(tmp_path, routing_replay="old"), train_dataset=chat_dataset(), processing_class=tok)
    plain = GRPOTrainer(transformers.AutoModelForCausalLM.from_config(cfg), varied_reward,
                        args=make_args(tmp_path), train_dataset=chat_dataset(), processing_class=tok)
    assert plain.moe.routers is None and not plain.moe.records_generation


def test_a_batch_without_the_samplers_recording_is_an_error_not_a_silent_skip(tmp_path):
    class Forgetful(TransformersRollout):
        def generate(self, *a, **kw):
            gen = super().generate(*a, **kw)
            gen.prompt_routes = gen.completion_routes = None
            return gen

    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_moe_model("qwen3_moe", tok), varied_reward,
                          args=make_args(tmp_path, routing_replay="rollout"), train_dataset=chat_dataset(),
                          processing_class=tok, rollout_backend=Forgetful(tok))
    with pytest.raises(RuntimeError, match="routing_replay='rollout': this batch holds no recording of the sampler's "
                                           "experts"):
        trainer.train()


def test_a_vision_language_moe_replays_the_old_pass_and_refuses_rollout_replay(tmp_path, taps):
    """Qwen3.5-MoE with images: generation does not record its experts (a VLM's generation is not laid out as its
    rows yet), so ``"rollout"`` is refused in one line; ``"old"`` records and forces the old pass's experts."""
    from datasets import Dataset
    from PIL import Image
    from tiny_vlm import tiny_vlm

    def image_dataset():
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What colour is picture {i}?"}]
                                             for i in range(4)],
                                  "image": [Image.new("RGB", (32 + 8 * i, 40), "red") for i in range(4)]})

    model, processor = tiny_vlm("qwen3_5_moe")
    with pytest.raises(ValueError, match=r"^routing_replay='rollout' is not allowed with a vision-language model: "):
        GRPOTrainer(model, varied_reward, args=make_args(tmp_path, routing_replay="rollout", num_generations=2),
                    train_dataset=image_dataset(), processing_class=processor)
    trainer = GRPOTrainer(model, varied_reward, args=make_args(tmp_path, routing_replay="old", num_generations=2,
                                                               num_iterations=2, learning_rate=0.1),
                          train_dataset=image_dataset(), processing_class=processor)
    trainer.train()
    assert len(taps) == 2 and all(forced is not None for forced, _, _ in taps)  # both passes over the batch
    replayed_exactly(taps)
