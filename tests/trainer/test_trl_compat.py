"""What a TRL 1.16 user relies on beyond the loss: reward models without a pad token in their config, the
``log_metric`` / ``log_extra`` reward-function callables, iterable datasets, TRL's metric names, the entropy bonus
and its adaptive controller, MoE router losses, QLoRA, and logging to trackers."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from runs import chat_dataset, make_args, train_logs, varied_reward
from tiny import tiny_model, tiny_tokenizer

from grpokit.trainer import GRPOTrainer


# -- reward models --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer_has_pad", [True, False])
def test_reward_model_whose_config_has_no_pad_token(tmp_path, tokenizer_has_pad):
    """Models made from Qwen2.5 / Qwen3 / Llama-3.2 configs have no pad_token_id: scoring a batch of more than one
    completion needs the reward model to learn the tokenizer's pad token (TRL sets it)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok, reward_tok = tiny_tokenizer(), tiny_tokenizer()
    if not tokenizer_has_pad:
        reward_tok.pad_token = None
    cfg = Qwen2Config(vocab_size=len(reward_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    assert cfg.pad_token_id is None
    reward_model = Qwen2ForSequenceClassification(cfg)
    trainer = GRPOTrainer(tiny_model(tok), reward_model, args=make_args(tmp_path), train_dataset=chat_dataset(),
                          processing_class=tok, reward_processing_classes=reward_tok)
    trainer.train()
    assert reward_model.config.pad_token_id == reward_tok.pad_token_id is not None
    assert all(math.isfinite(h[f"rewards/{trainer.reward_func_names[0]}/mean"]) for h in train_logs(trainer))


# -- log_metric / log_extra ----------------------------------------------------------------------------------------
def test_reward_functions_get_log_metric_and_log_extra(tmp_path, monkeypatch):
    seen = {}

    def reward(completions, log_metric, log_extra, trainer_state, **kw):
        lengths = [len(c[0]["content"]) for c in completions]
        log_metric("custom/mean_chars", sum(lengths) / len(lengths))
        log_metric("custom/mean_chars", 0.0)  # logged twice in one batch: the mean of both
        log_extra("chars", lengths)
        seen.setdefault("lengths", []).append(lengths)
        return [x / 10 for x in lengths]

    tables = []
    import grpokit.reporting.tables as tables_module

    monkeypatch.setattr(tables_module, "log_completions_table", lambda *a, **k: tables.append(k["extra"]))
    trainer = GRPOTrainer(tiny_model(tiny_tokenizer()), reward, args=make_args(tmp_path, log_completions=True),
                          train_dataset=chat_dataset(), processing_class=tiny_tokenizer())
    trainer.train()
    logs = train_logs(trainer)
    for h, lengths in zip(logs, seen["lengths"]):
        assert h["custom/mean_chars"] == pytest.approx(sum(lengths) / len(lengths) / 2)
    assert tables and tables[-1]["chars"] == seen["lengths"][-1]


# -- iterable datasets --------------------------------------------------------------------------------------------
def test_iterable_dataset_trains_in_whole_groups(tmp_path):
    tok = tiny_tokenizer()
    stream = chat_dataset(12).to_iterable_dataset()
    groups = []
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, max_steps=3, shuffle_dataset=False),
                          train_dataset=stream, processing_class=tok)
    original = trainer.pipeline.sample

    def record(rows, driver, mode="train"):
        groups.append([r["answer"] for r in rows])
        return original(rows, driver, mode)

    trainer.pipeline.sample = record
    trainer.train()
    assert trainer.state.global_step == 3
    assert groups == [["0"] * 4, ["2"] * 4, ["4"] * 4]  # the stream in order, each row num_generations times
    assert trainer.args.accelerator_config.dispatch_batches is False


def test_iterable_dataset_needs_max_steps_and_its_own_dispatch(tmp_path):
    tok = tiny_tokenizer()
    stream = chat_dataset(8).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"max_steps=-1 is not allowed with an IterableDataset"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, max_steps=-1), train_dataset=stream,
                    processing_class=tok)
    args = make_args(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="dispatch_batches=True is not allowed"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=stream, processing_class=tok)


def test_an_eval_stream_reads_with_one_worker_and_leaves_the_train_loader_alone(tmp_path):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, dataloader_num_workers=2, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(),
                          eval_dataset=chat_dataset(8).to_iterable_dataset(), processing_class=tok)
    assert trainer.get_train_dataloader().num_workers == 2   # a map-style train set keeps its workers
    assert trainer.get_eval_dataloader().num_workers == 0    # workers would split a stream's groups
    assert trainer.args.dataloader_num_workers == 2          # for that loader only
    # a stream first seen by evaluate(): every process reads it (accelerate would dispatch batches of strings)
    late = GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path / "late", per_device_eval_batch_size=4),
                       train_dataset=chat_dataset(), processing_class=tok)
    metrics = late.evaluate(eval_dataset=chat_dataset(8).to_iterable_dataset())
    assert math.isfinite(metrics["eval_loss"]) and any("eval_reward" in h for h in late.state.log_history)


# -- metrics, entropy bonus ----------------------------------------------------------------------------------------
def test_trl_metric_names(tmp_path):
    trainer = GRPOTrainer(tiny_model(tiny_tokenizer()), varied_reward, args=make_args(tmp_path, loss_type="grpo"),
                          train_dataset=chat_dataset(), processing_class=tiny_tokenizer())
    trainer.train()
    for h in train_logs(trainer):
        for key in ("clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/region_mean", "completions/min_length",
                    "completions/max_length", "frac_reward_zero_std", "num_tokens", "step_time", "entropy"):
            assert key in h, key
        assert h["clip_ratio/low_min"] == 0.0 and h["clip_ratio/high_max"] == 0.0  # on-policy: nothing clipped
        if "completions/mean_terminated_length" in h:
            assert h["completions/min_terminated_length"] <= h["completions/mean_terminated_length"] \
                <= h["completions/max_terminated_length"]


def test_entropy_bonus_logs_policy_loss_and_coef(tmp_path):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, entropy_coef=0.5)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok)
    trainer.train()
    for h in train_logs(trainer):
        assert h["entropy_coef"] == 0.5
        # the logged loss is the policy term minus 0.5·entropy (one micro-batch per step)
        assert h["loss"] == pytest.approx(h["policy_loss"] - 0.5 * h["entropy"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_the_entropy_bonus_alone_moves_the_weights(tmp_path, coef):
    # a constant reward: every advantage is 0, so the policy term has no gradient; only the bonus can move anything
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, lambda completions, **kw: [1.0] * len(completions),
                          args=make_args(tmp_path, entropy_coef=coef, max_steps=1), train_dataset=chat_dataset(),
                          processing_class=tok)
    trainer.train()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert (len(moved) > 0) == (coef > 0), moved


def test_adaptive_entropy_moves_the_coefficient_and_resumes_it(tmp_path):
    tok = tiny_tokenizer()
    # the tiny random model's entropy (~5.5 nats) is far above the target: each step lowers the coefficient
    args = make_args(tmp_path, use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.1,
                     entropy_target=0.2, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok)
    trainer.train()
    coefs = [h["entropy_coef"] for h in train_logs(trainer)]
    assert coefs == pytest.approx([0.2, 0.1])
    assert trainer.entropy_coef == pytest.approx(0.1)  # TRL's attribute: the controller's current value
    state = json.loads(open(os.path.join(args.output_dir, "checkpoint-2", "entropy_ctrl_state.json")).read())
    assert state["entropy_coef"] == pytest.approx(0.1) and state["last_world_entropy"] > 0.2
    resumed = GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, use_adaptive_entropy=True,
                          entropy_coef=0.3, entropy_coef_delta=0.1, entropy_target=0.2, max_steps=3),
                          train_dataset=chat_dataset(), processing_class=tok)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert [h["entropy_coef"] for h in train_logs(resumed)][-1] == pytest.approx(0.0)  # 0.1 - 0.1, floor 0
    static = GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path / "static", entropy_coef=0.05),
                         train_dataset=chat_dataset(), processing_class=tok)
    assert static.entropy_coef == 0.05


# -- MoE ------------------------------------------------------------------------------------------------------------
def tiny_moe(tok):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=tok.eos_token_id)
    return Qwen3MoeForCausalLM(cfg)


def test_moe_router_aux_loss(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_moe(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, varied_reward, args=make_args(tmp_path), train_dataset=chat_dataset(),
                          processing_class=tok)
    assert trainer.router_aux_loss_coef == pytest.approx(0.001)  # the model config's, as TRL
    assert trainer.aux_loss_enabled is True  # TRL's attribute
    trainer.train()
    logs = train_logs(trainer)
    assert all(h["aux_loss"] > 0 for h in logs)
    routers = [n for n in before if "gate" in n and "experts" not in n]
    assert routers and all(not torch.equal(before[n], model.get_parameter(n)) for n in routers)
    off = GRPOTrainer(tiny_moe(tok), varied_reward, args=make_args(tmp_path, router_aux_loss_coef=0.0),
                      train_dataset=chat_dataset(), processing_class=tok)
    assert off.router_aux_loss_coef == 0.0 and off.aux_loss_enabled is False


def test_router_aux_loss_coef_on_a_dense_model_is_an_error(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 is not allowed: LlamaForCausalLM is not a Mixture"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, router_aux_loss_coef=0.01),
                    train_dataset=chat_dataset(), processing_class=tok)


# -- QLoRA ----------------------------------------------------------------------------------------------------------
def test_qlora_trains_the_adapter_on_a_4bit_base(tmp_path):
    """bitsandbytes' 4-bit layers run on this CPU: the base is quantised at load, the LoRA adapter (bf16, as TRL)
    trains, the quantised base stays as it was."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    tok = tiny_tokenizer()
    directory = tmp_path / "base"
    tiny_model(tok, hidden=64).save_pretrained(directory)
    tok.save_pretrained(directory)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    trainer = GRPOTrainer(str(directory), varied_reward, args=make_args(tmp_path, learning_rate=5e-2),
                          train_dataset=chat_dataset(), processing_class=tok, quantization_config=q,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = trainer.model
    assert model.get_base_model().is_loaded_in_4bit
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(p.dtype == torch.bfloat16 for p in lora.values())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer.train()
    assert all(not torch.equal(lora[n], model.get_parameter(n)) for n in lora if "lora_B" in n)
    assert all(torch.equal(base[n], model.get_parameter(n)) for n in base)


# -- trackers -------------------------------------------------------------------------------------------------------
def test_report_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "out"  # transformers 5 writes the events under output_dir/runs/
    trainer = GRPOTrainer(tiny_model(tiny_tokenizer()), varied_reward, args=make_args(tmp_path, report_to="tensorboard"),
                          train_dataset=chat_dataset(), processing_class=tiny_tokenizer())
    trainer.train()
    events = EventAccumulator(str(next(p.parent for p in logdir.rglob("events.out.tfevents.*"))))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/loss", "train/entropy", "train/completions/mean_length"} <= tags
    assert len(events.Scalars("train/reward")) == 2


def test_report_to_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    real_log = wandb.sdk.wandb_run.Run.log

    def spy(self, data, *a, **k):  # what the run receives (its files are written by wandb's own service process)
        logged.append(dict(data))
        return real_log(self, data, *a, **k)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    args = make_args(tmp_path, report_to="wandb", log_completions=True, log_unique_prompts=True)
    trainer = GRPOTrainer(tiny_model(tiny_tokenizer()), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tiny_tokenizer())
    trainer.train()
    wandb.finish()
    tables = [d["completions"] for d in logged if "completions" in d]
    assert len(tables) == 2 and all(len(t.data) == 1 for t in tables)  # one prompt × 4 completions: one row
    assert {"step", "prompt", "completion", "varied_reward", "advantage"} <= set(tables[0].columns)
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    steps = [d for d in logged if "train/reward" in d]
    assert len(steps) == 2 and all({"train/entropy", "train/completions/mean_length", "train/loss"} <= set(d)
                                   for d in steps)


def test_trl_mask_methods_give_hand_computed_values():
    # TRL's public helpers, for subclasses written against TRL; grpokit's algorithms behind them
    one_process = type("T", (), {"accelerator": type("A", (), {"num_processes": 1})()})()
    entropies = torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.7, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # valid entropies 0.1 0.3 0.5 0.7 0.9: their 0.5-quantile is 0.5; the padded 2.0 takes no part
    got = GRPOTrainer.get_high_entropy_mask(one_process, entropies, mask, 0.5)
    assert got.dtype == torch.bool and got.tolist() == [[True, False, True], [False, True, False]]
    assert GRPOTrainer.get_high_entropy_mask(one_process, entropies, mask, 0.0).tolist() == mask.bool().tolist()
    assert not GRPOTrainer.get_high_entropy_mask(one_process, entropies, torch.zeros_like(mask), 0.5).any()

    advantages = torch.tensor([[0.5], [-0.5], [-0.5]])
    sampler = torch.zeros(3, 2)
    logps = torch.tensor([[-3.0, -3.0], [-0.2, -0.4], [-1.0, -9.0]])   # mean drift 3.0, 0.3, and 1.0 over the valid token
    valid = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, valid, 0.5)
    assert keep.tolist() == [[1.0], [1.0], [0.0]]   # positive advantage kept; negative kept only while drift ≤ 0.5
    assert GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, valid, 1.0).tolist() == [[1.0], [1.0], [1.0]]


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_logged_reward_is_weighted_under_both_aggregations(tmp_path, aggregation):
    # as TRL logs it: the raw rewards weighted (0.7·1 + 0.3·0), not the normalised sum behind the advantages (0)
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), [lambda completions, **kw: [1.0] * len(completions),
                                            lambda completions, **kw: [0.0] * len(completions)],
                          args=make_args(tmp_path, reward_weights=[0.7, 0.3], multi_objective_aggregation=aggregation,
                                         max_steps=1),
                          train_dataset=chat_dataset(), processing_class=tok)
    trainer.train()
    assert train_logs(trainer)[-1]["reward"] == pytest.approx(0.7)
