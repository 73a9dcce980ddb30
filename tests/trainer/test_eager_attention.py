"""Eager attention instead of SDPA in the trainer's log-prob forwards, for bf16 weights on a CPU and short sequences
(grpokit/forward/attention.py): when it switches, that it always switches back, that the log-probs and their
gradients are SDPA's up to bf16 rounding, and, through GRPOTrainer, that the loss's forward and backward (the
recomputation under gradient checkpointing too) run eager attention while generation keeps SDPA."""

from __future__ import annotations

import contextlib

import pytest
import torch
from runs import chat_dataset, make_args, params_of, varied_reward
from tiny import tiny_model, tiny_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama import modeling_llama

from grpokit.forward import attention
from grpokit.forward.attention import eager_attention_where_faster
from grpokit.forward.logprobs import completion_logps
from grpokit.trainer import GRPOTrainer

FLASH = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


class Kernels(TorchDispatchMode):
    """Counts SDPA's CPU kernel calls (forward and backward) inside the block."""

    def __init__(self):
        super().__init__()
        self.flash = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.flash += func in FLASH
        return func(*args, **(kwargs or {}))


@pytest.fixture
def eager_calls(monkeypatch):
    """How many times transformers' eager attention ran (a list of one counter)."""
    count = [0]
    real = modeling_llama.eager_attention_forward

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", counted)
    return count


def bf16_model(**kw):
    model = tiny_model(**kw).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return model


def test_it_switches_bf16_on_a_cpu_for_short_sequences_and_always_switches_back():
    model = bf16_model()
    with eager_attention_where_faster(model, 4, 20) as switched:
        assert switched and model.config._attn_implementation == "eager"
        with eager_attention_where_faster(model, 4, 20) as inner:  # nested: the outer block's choice holds
            assert not inner
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), eager_attention_where_faster(model, 4, 20):
        raise RuntimeError("a forward that fails")
    assert model.config._attn_implementation == "sdpa"

    heads = model.config.num_attention_heads  # one layer's attention weights just over the bound: SDPA kept
    positions = int((attention.EAGER_MAX_ATTENTION_BYTES / (4 * heads * 4)) ** 0.5) + 1
    with eager_attention_where_faster(model, 4, positions) as switched:
        assert not switched and model.config._attn_implementation == "sdpa"
    with eager_attention_where_faster(model, 4, positions - 1) as switched:
        assert switched

    float32 = tiny_model()
    float32.config._attn_implementation = "sdpa"
    with eager_attention_where_faster(float32, 4, 20) as switched:  # float32: SDPA is the faster there
        assert not switched and float32.config._attn_implementation == "sdpa"

    chosen = bf16_model()
    chosen.config._attn_implementation = "flex_attention"  # a user's own choice is never changed
    with eager_attention_where_faster(chosen, 4, 20) as switched:
        assert not switched and chosen.config._attn_implementation == "flex_attention"


def test_under_gradient_checkpointing_only_a_block_holding_the_backward_switches():
    model = bf16_model()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with eager_attention_where_faster(model, 4, 20) as switched:  # the recomputation would run outside the block
        assert not switched
    with eager_attention_where_faster(model, 4, 20, holds_backward=True) as switched:
        assert switched
    with torch.no_grad(), eager_attention_where_faster(model, 4, 20) as switched:  # nothing is recomputed
        assert switched


def _logps_and_grads(model, ids, mask, completion, completion_mask):
    model.zero_grad()
    logps, _ = completion_logps(model, ids, mask, completion, completion_mask, compute_entropy=False)
    (logps.float() * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    return logps.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_the_log_probs_and_their_gradients_are_sdpas_up_to_bf16_rounding(monkeypatch, eager_calls):
    tok = tiny_tokenizer()
    model = bf16_model(tokenizer=tok, hidden=64, layers=2)
    torch.manual_seed(1)
    ids = torch.randint(4, len(tok), (6, 9))
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # left padding
    completion = torch.randint(4, len(tok), (6, 7))
    completion_mask = torch.ones_like(completion)
    completion_mask[3, 4:] = 0

    kernels = Kernels()
    with kernels:
        eager_logps, eager_grads = _logps_and_grads(model, ids, mask, completion, completion_mask)
    assert eager_calls[0] > 0 and kernels.flash == 0, (eager_calls, kernels.flash)
    assert model.config._attn_implementation == "sdpa"

    monkeypatch.setattr(attention, "EAGER_MAX_ATTENTION_BYTES", 0)  # SDPA, as before the switch existed
    eager_calls[0] = 0
    kernels = Kernels()
    with kernels:
        sdpa_logps, sdpa_grads = _logps_and_grads(model, ids, mask, completion, completion_mask)
    assert eager_calls[0] == 0 and kernels.flash > 0

    valid = completion_mask.bool()
    assert torch.equal(eager_logps[~valid], sdpa_logps[~valid])
    torch.testing.assert_close(eager_logps[valid], sdpa_logps[valid], atol=0.06, rtol=0.02)
    assert (eager_logps[valid] - sdpa_logps[valid]).abs().mean() < 0.01
    for name, grad in sdpa_grads.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (eager_grads[name] - grad).abs().max() / scale < 0.1, name
        assert torch.nn.functional.cosine_similarity(eager_grads[name].flatten(), grad.flatten(), 0) > 0.99, name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grpo_trainer_trains_with_eager_attention_and_generates_with_sdpa(tmp_path, monkeypatch, checkpointing):
    tok = tiny_tokenizer()
    model = bf16_model(tokenizer=tok)
    kernels = PhasedKernels()
    real_eager = modeling_llama.eager_attention_forward

    def counted(*args, **kwargs):
        kernels.eager[kernels.phase] += 1
        return real_eager(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", counted)

    class Recorded(GRPOTrainer):  # which phase of a training step runs which attention
        def _prepare_inputs(self, *args, **kwargs):
            with kernels.during("rollout"):  # generation, rewards, the behaviour log-probs
                return super()._prepare_inputs(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            with kernels.during("loss"):
                return super().compute_loss(*args, **kwargs)

    args = make_args(tmp_path, max_steps=2, gradient_checkpointing=checkpointing, num_iterations=2,
                     learning_rate=5e-2)
    trainer = Recorded(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok)
    backward = trainer.accelerator.backward

    def phased_backward(*args, **kwargs):
        with kernels.during("backward"):
            return backward(*args, **kwargs)

    trainer.accelerator.backward = phased_backward
    before = params_of(trainer.model, trainable_only=True)
    with kernels:
        trainer.train()
    # the loss's forward ran eager attention in every layer, its backward too where it recomputes the forward
    # (gradient checkpointing), and neither ran SDPA's kernel
    assert kernels.eager["loss"] >= 2 * model.config.num_hidden_layers, kernels.eager
    assert kernels.eager["backward"] == (kernels.eager["loss"] if checkpointing else 0), kernels.eager
    assert kernels.flash["loss"] == kernels.flash["backward"] == 0, kernels.flash
    # generation's prefill ran SDPA (its decode steps call SDPA themselves); the behaviour log-probs of
    # num_iterations 2 are a log-prob forward like the loss's, and take the same kernel
    assert kernels.flash["rollout"] > 0 and kernels.eager["rollout"] > 0
    assert model.config._attn_implementation == "sdpa"
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert sorted(moved) == sorted(before), set(before) - set(moved)


class PhasedKernels(TorchDispatchMode):
    """SDPA's CPU kernel calls (and, counted by the test, eager attention's) inside the block, by :attr:`phase`."""

    def __init__(self):
        super().__init__()
        self.phase = "outside"
        self.flash = dict.fromkeys(("outside", "rollout", "loss", "backward"), 0)
        self.eager = dict(self.flash)

    @contextlib.contextmanager
    def during(self, phase: str):
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.flash[self.phase] += func in FLASH
        return func(*args, **(kwargs or {}))
