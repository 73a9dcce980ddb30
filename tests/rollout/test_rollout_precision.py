"""``rollout_precision``: sampling with copies of the policy's linear layers in float32, bf16 or int8.

The int8 sampler's log-probs are checked against a hand-dequantised model (each weight ``q·s``, activations rounded to
bf16 as the kernel reads them, its output rounded to bf16), the copies against the weights of the latest optimizer
step at every generation, and the mismatch correction through ``GRPOTrainer``."""

from __future__ import annotations

import copy

import pytest
import torch
from runs import chat_dataset, first_loss_inputs, make_args, train_logs, varied_reward
from tiny import tiny_model, tiny_tokenizer
from transformers import TopKLogitsWarper

from grpokit.algorithms.importance import sampler_importance_ratio
from grpokit.forward.logprobs import completion_logps
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.packed import packed_linears, packed_weight
from grpokit.rollout.precision import GenerationCopy, bytes_per_decode_step, copy_precision, quantize_int8
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.trainer import GRPOTrainer


def test_int8_quantisation_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.tensor([1e-3, 0.02, 1.0, 3.0, 50.0, 0.0])[:, None]
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.bfloat16 and q.scale.shape == (6,)
    assert int(q.q.abs().max()) <= 127
    amax = w.abs().amax(1)
    assert bool((q.scale.float() * 127 >= amax).all())  # no weight is clipped
    live = amax > 0
    assert bool((q.scale.float()[live] * 127 <= amax[live] * (1 + 2 ** -7)).all())  # the nearest bf16 above
    err = (q.dequantized() - w).abs()
    assert bool((err <= q.scale.float()[:, None] / 2 + 1e-12).all())  # rounding to the nearest step
    assert float(q.q[5].abs().max()) == 0 and float(q.scale[5]) == 1.0  # a row of zeros


def test_an_int8_copy_computes_with_the_dequantised_weight():
    torch.manual_seed(1)
    w, b, x = torch.randn(24, 40) * 0.05, torch.randn(24), torch.randn(5, 40)
    c = GenerationCopy(w, "int8")
    want = (x.bfloat16().float() @ c.reference_weight().T).bfloat16().float() + b
    torch.testing.assert_close(c(x, b), want, atol=2e-2 * float(want.abs().max()) / 100, rtol=1e-2)
    assert (c(x, b) - (x @ w.T + b)).abs().max() > 1e-3  # and not with the float weight itself


def _int8_reference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every linear layer computing as the int8 copy does, written out by hand: ``x`` rounded to bf16,
    times ``q·s`` (dequantised: :meth:`Int8Weight.dequantized`), rounded to bf16, plus the bias."""
    ref = copy.deepcopy(model)
    for layer in [m for m in ref.modules() if type(m) is torch.nn.Linear]:
        w = quantize_int8(layer.weight).dequantized()

        def forward(x, w=w, bias=layer.bias):
            out = torch.nn.functional.linear(x.bfloat16().float(), w).bfloat16().to(x.dtype)
            return out if bias is None else out + bias

        layer.forward = forward
    return ref


def _on_top_k(model, ids, mask, gen, temperature, top_k):
    full = torch.cat([ids, gen.completion_ids], 1)
    full_mask = torch.cat([mask, gen.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].float()
    scores = TopKLogitsWarper(top_k)(None, logits.flatten(0, 1) / temperature)
    lp = torch.log_softmax(scores, -1).gather(-1, gen.completion_ids.reshape(-1, 1)).view_as(gen.completion_ids)
    return lp.masked_fill(gen.completion_mask == 0, 0.0)


@pytest.mark.parametrize("lora", [False, True])
def test_int8_sampler_logps_equal_a_hand_dequantised_model(lora):
    tok = tiny_tokenizer()
    model = tiny_model(tok, hidden=64).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # a trained adapter: B away from its zero initialisation
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        merged = copy.deepcopy(model).merge_and_unload().eval()  # what the folded copy quantises
    else:
        merged = model
    enc = tok.apply_chat_template([[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(3)],
                                  add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"].repeat_interleave(2, 0)
    mask = enc["attention_mask"].repeat_interleave(2, 0)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=7)
    backend = TransformersRollout(tok, rollout_precision="int8")
    torch.manual_seed(0)
    gen = backend.generate(model, ids, mask, params)
    assert gen.sampler_logps is not None and gen.sampler_logps.shape == gen.completion_ids.shape
    want = _on_top_k(_int8_reference(merged), ids, mask, gen, 0.8, 7)
    own = _on_top_k(merged, ids, mask, gen, 0.8, 7)
    valid = gen.completion_mask.bool()
    gap = (gen.sampler_logps - want)[valid].abs().max()
    assert gap < 2e-3, gap
    assert (own - want)[valid].abs().max() > 5 * gap  # the test tells int8 from the policy's own weights
    assert not any(isinstance(packed_weight(m), GenerationCopy) or "forward" in vars(m) for m in model.modules())
    for p_name, p in model.named_parameters():  # the policy's weights are untouched
        assert p.dtype == torch.float32, p_name


def test_copies_follow_the_model_dtype_and_auto_makes_none():
    model = tiny_model(tiny_tokenizer())
    assert copy_precision("auto", model) is None
    assert copy_precision("float32", model) is None  # already its precision: its own weights sample
    assert copy_precision("bf16", model) == "bf16"
    assert copy_precision("int8", model) == "int8"
    assert copy_precision("float32", model.to(torch.bfloat16)) == "float32"
    n = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    rows = sum(m.weight.shape[0] for m in model.modules() if type(m) is torch.nn.Linear)
    assert bytes_per_decode_step(model, "int8") == n + 2 * rows
    assert bytes_per_decode_step(model, "float32") == 4 * n
    assert bytes_per_decode_step(model, None) == 2 * n  # bf16 now


def test_a_bf16_copy_of_a_float32_model_samples_and_reports_its_logps():
    tok = tiny_tokenizer()
    model = tiny_model(tok, hidden=64).eval()
    ids = torch.tensor([[5, 6, 7, 8]] * 4)
    mask = torch.ones_like(ids)
    backend = TransformersRollout(tok, rollout_precision="bf16")
    gen = backend.generate(model, ids, mask, SamplingParams(max_new_tokens=6, temperature=1.0))
    full = torch.cat([ids, gen.completion_ids], 1)
    with torch.no_grad(), packed_linears(model, 4, "bf16"):  # the copy's own distribution
        logits = model(input_ids=full).logits[:, ids.shape[1] - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, gen.completion_ids[..., None])[..., 0]
    valid = gen.completion_mask.bool()
    torch.testing.assert_close(gen.sampler_logps[valid], want[valid], atol=1e-3, rtol=0)


def test_auto_samples_with_the_policy_itself_and_reports_nothing():
    tok = tiny_tokenizer()
    gen = TransformersRollout(tok).generate(tiny_model(tok), torch.tensor([[5, 6, 7]] * 2), torch.ones(2, 3,
                                            dtype=torch.long), SamplingParams(max_new_tokens=4))
    assert gen.sampler_logps is None


def test_the_copies_are_made_from_the_latest_weights_at_every_generation(tmp_path, monkeypatch):
    """Through GRPOTrainer with rollout_precision='int8': every generation's int8 copy of a layer is the quantisation
    of that layer's weight as the optimizer left it, and the weights (so the copies) change from step to step."""
    tok = tiny_tokenizer()
    seen = []
    generate = TransformersRollout.generate

    def checked(self, model, prompt_ids, prompt_mask, params, **kw):
        layer = model.model.layers[0].mlp.down_proj
        copied = packed_weight(layer)
        assert isinstance(copied, GenerationCopy), "generation_batch made no copy"
        torch.testing.assert_close(copied.int8.q, quantize_int8(layer.weight).q, atol=0, rtol=0)
        seen.append(layer.weight.detach().clone())
        return generate(self, model, prompt_ids, prompt_mask, params, **kw)

    monkeypatch.setattr(TransformersRollout, "generate", checked)
    args = make_args(tmp_path, rollout_precision="int8", max_steps=3, temperature=0.9)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok)
    trainer.train()
    assert len(seen) >= 3
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))  # a new step, new weights, a new copy


@pytest.mark.parametrize("correct", [True, False])
def test_the_mismatch_correction_applies_to_an_int8_sampler_through_the_trainer(tmp_path, correct):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, rollout_precision="int8", temperature=0.9,
                     vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                     vllm_importance_sampling_correction=correct)
    trainer = GRPOTrainer(tiny_model(tok, hidden=64), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok)
    first_policy = copy.deepcopy(trainer.model)
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    batch = seen["batch"]  # on-policy: the loss's own forward is the trainer's side of the mismatch
    assert batch.sampler_logps is not None and batch.old_logps is None
    valid = batch.loss_mask.bool()
    with torch.no_grad():
        trainer_logps, _ = completion_logps(first_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                            batch.completion_mask, temperature=0.9, compute_entropy=False)
    gap = (trainer_logps - batch.sampler_logps)[valid].abs()
    assert float(gap.max()) > 0  # the int8 sampler is not the trainer
    if correct:
        want = sampler_importance_ratio(trainer_logps, batch.sampler_logps, batch.loss_mask.float(),
                                        "token_truncate", None, 2.0)
        torch.testing.assert_close(seen["sampler_ratio"], want)
        assert not torch.equal(want[valid], torch.ones_like(want[valid]))
    else:
        assert seen["sampler_ratio"] is None
    logs = train_logs(trainer)
    assert all("sampling/mismatch_kl_k3" in h for h in logs)
    assert all(("sampling/importance_sampling_ratio/mean" in h) == correct for h in logs)


@pytest.mark.parametrize("setting, why", [
    (dict(rollout_precision="fp8"), "rollout_precision='fp8' is not allowed"),
    (dict(rollout_precision="int8", use_transformers_continuous_batching=True),
     "rollout_precision='int8' is not allowed with use_transformers_continuous_batching=True"),
    (dict(rollout_precision="bf16", partial_rollouts=True, max_staleness=1),
     "rollout_precision='bf16' is not allowed with partial_rollouts=True"),
])
def test_settings_it_does_not_take_are_refused_in_one_line(tmp_path, setting, why):
    with pytest.raises(ValueError) as e:
        make_args(tmp_path, **setting)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_policy_off_the_cpu_is_refused_in_one_line(tmp_path):
    from grpokit.rollout.backends import default_rollout

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="rollout_precision='int8' is not allowed with the policy on meta"):
        default_rollout(tiny_model(tok).to("meta"), tok, make_args(tmp_path, rollout_precision="int8"))


@pytest.mark.parametrize("workers", [0, 1])
def test_asynchronous_rollouts_and_workers_sample_with_copies_and_log_the_mismatch(tmp_path, workers):
    """max_staleness=1 (a producer thread, or a rollout worker process): the copies are made from the sampler's own
    weights, the batch carries its log-probs, and the mismatch against the behaviour policy is logged every step."""
    tok = tiny_tokenizer()
    args = make_args(tmp_path, rollout_precision="int8", max_staleness=1, rollout_workers=workers, max_steps=3,
                     temperature=0.9)
    trainer = GRPOTrainer(tiny_model(tok, hidden=64), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok)
    trainer.train()
    logs = train_logs(trainer)
    assert len(logs) == 3 and all(float(h["sampling/mismatch_kl_k3"]) > 0 for h in logs)


def _machine(monkeypatch, speedup: float, native: bool = True, min_bytes: int = 0) -> None:
    """This CPU as one whose bf16 products are ``speedup`` times float32's (``native``: it has bf16 units), and the
    size below which ``"auto"`` does not copy."""
    import grpokit.machine.cpu_features as features
    import grpokit.rollout.auto_precision as precision

    monkeypatch.setattr(features, "measured_bf16_speedup", lambda: speedup)
    monkeypatch.setattr(features, "native_bf16", lambda: native)
    monkeypatch.setattr(precision, "AUTO_COPY_MIN_BYTES", min_bytes)


@pytest.mark.parametrize("speedup", [5.6, 2.0])  # a Xeon's AMX; an AMD EPYC's AVX512-BF16
def test_auto_samples_a_float32_policy_with_bf16_copies_where_that_pays_and_corrects_it(tmp_path, monkeypatch, caplog,
                                                                                       speedup):
    import logging

    _machine(monkeypatch, speedup=speedup)
    tok = tiny_tokenizer()
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer = GRPOTrainer(tiny_model(tok, hidden=64), varied_reward, args=make_args(tmp_path, temperature=0.9),
                              train_dataset=chat_dataset(), processing_class=tok)
    said = [r.getMessage() for r in caplog.records if "rollout_precision='auto'" in r.getMessage()]
    assert len(said) == 1 and "bf16 copies" in said[0] and f"{speedup:.1f}x" in said[0] and "\n" not in said[0]
    assert trainer.rollout.copy_precision(trainer.model) == "bf16"
    first_policy = copy.deepcopy(trainer.model)
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    batch = seen["batch"]
    assert batch.sampler_logps is not None and batch.old_logps is None
    with torch.no_grad():
        trainer_logps, _ = completion_logps(first_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                            batch.completion_mask, temperature=0.9, compute_entropy=False)
    want = sampler_importance_ratio(trainer_logps, batch.sampler_logps, batch.loss_mask.float(), "sequence_mask",
                                    None, 3.0)  # GRPOConfig's (TRL's) defaults
    torch.testing.assert_close(seen["sampler_ratio"], want)
    assert all(h["sampling/mismatch_kl_k3"] > 0 for h in train_logs(trainer))


@pytest.mark.parametrize("machine, setting", [
    (dict(speedup=1.4), {}),  # bf16 units that multiply barely faster than float32 (below BF16_MIN_SPEEDUP)
    (dict(speedup=0.7), {}),  # a Xeon's cores with AMX off
    (dict(speedup=5.6, native=False), {}),  # no bf16 units
    (dict(speedup=5.6, min_bytes=2**30), {}),  # a policy whose weights stay in the caches
    (dict(speedup=5.6), dict(rollout_precision="float32")),  # asked for the policy's own weights
    (dict(speedup=5.6), dict(vllm_importance_sampling_correction=False)),  # nothing would correct the copies
    (dict(speedup=5.6), dict(loss_type="vespo")),  # its sequence-level default would be refused
    (dict(speedup=5.6), dict(max_staleness=1)),  # a producer's behaviour log-probs are the sampler's
])
def test_auto_keeps_the_policys_own_weights_where_copies_do_not_pay_or_apply(tmp_path, monkeypatch, machine, setting):
    _machine(monkeypatch, **machine)
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok, hidden=64), varied_reward, args=make_args(tmp_path, **setting),
                          train_dataset=chat_dataset(), processing_class=tok)
    assert trainer.rollout.copy_precision(trainer.model) is None


def test_auto_keeps_a_bf16_policys_own_weights(tmp_path, monkeypatch):
    _machine(monkeypatch, speedup=5.6)
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok, hidden=64).to(torch.bfloat16), varied_reward, args=make_args(tmp_path),
                          train_dataset=chat_dataset(), processing_class=tok)
    assert trainer.rollout.copy_precision(trainer.model) is None
