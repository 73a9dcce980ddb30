"""LoRA layers as one autograd operation (grpokit/forward/fused_lora.py): the manual backward against numerical derivatives
and against PEFT's own layers, through completion_logps and through GRPOTrainer's training step (with and without
gradient checkpointing), and every call it must leave to PEFT."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from runs import varied_reward
from tiny import tiny_model, tiny_tokenizer

import grpokit.forward.logprobs
import grpokit.trainer
from grpokit.config import GRPOConfig
from grpokit.forward.fused_lora import LoRALinear, fused_lora
from grpokit.forward.logprobs import completion_logps
from grpokit.forward.lora_layers import lora_layers
from grpokit.rollout.packed import foldable_lora
from grpokit.trainer import GRPOTrainer


def _lora_model(dtype=torch.float32, seed=0, **lora):
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed).to(dtype)
    cfg = dict(r=4, lora_alpha=8, target_modules="all-linear")
    cfg.update(lora)
    model = get_peft_model(model, LoraConfig(**cfg))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # PEFT starts B at zero, where A gets no gradient: both moved
        for layer in lora_layers(model):
            for b in layer.lora_B.values():
                b.weight.normal_(0, 0.3)
    return model.to(dtype), tok


class _Counting:
    """How often LoRALinear's forward and backward ran."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        self.dtypes = set()  # of the rows multiplied
        fwd, bwd = LoRALinear.forward, LoRALinear.backward

        def forward(ctx, *args):
            self.forward += 1
            self.dtypes.add(args[0].dtype)
            return fwd(ctx, *args)

        def backward(ctx, *args):
            self.backward += 1
            return bwd(ctx, *args)

        monkeypatch.setattr(LoRALinear, "forward", staticmethod(forward))
        monkeypatch.setattr(LoRALinear, "backward", staticmethod(torch.autograd.function.once_differentiable(backward)))


def test_backward_against_numerical_derivatives():
    torch.manual_seed(0)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    w, bias = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    a = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: LoRALinear.apply(x, w, bias, a, b, 2.5), (x, a, b))
    assert torch.autograd.gradcheck(lambda x, a, b: LoRALinear.apply(x, w, None, a, b, 0.5), (x, a, b))
    y = LoRALinear.apply(x, w, bias, a, b, 2.5)
    torch.testing.assert_close(y, x @ w.T + bias + 2.5 * (x @ a.T) @ b.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_log_probs_and_gradients_as_peft(dtype, monkeypatch):
    model, tok = _lora_model(dtype)
    model.train()
    torch.manual_seed(3)
    prompt_ids = torch.randint(4, len(tok), (4, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(4, len(tok), (4, 5))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0

    def run():
        model.zero_grad(set_to_none=True)
        logps, ents = completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        (logps * completion_mask).sum().backward()
        return logps.detach(), ents.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.requires_grad}

    count = _Counting(monkeypatch)
    fused = run()
    assert count.forward >= len(lora_layers(model)) and count.backward >= len(lora_layers(model))
    monkeypatch.setattr(grpokit.forward.logprobs, "fused_lora", lambda model: contextlib.nullcontext(0))
    peft = run()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused[0], peft[0], **tol)
    torch.testing.assert_close(fused[1], peft[1], **tol)
    assert fused[2].keys() == peft[2].keys() and len(fused[2]) == 2 * len(lora_layers(model))
    for name in peft[2]:
        assert peft[2][name].abs().max() > 0, name  # every adapter matrix gets a gradient
        torch.testing.assert_close(fused[2][name], peft[2][name], **tol)
    assert all("forward" not in vars(m) for m in lora_layers(model))  # PEFT's forward back after the block
    if dtype == torch.float32:  # generation still folds every adapter into its packed weight
        assert len(foldable_lora(model)) == len(lora_layers(model))


def _trainer(out, model, tok, **kw):
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                      disable_tqdm=True, learning_rate=0.1, optim="sgd", max_steps=1, **kw)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(8)]})
    return GRPOTrainer(model, varied_reward, args=args, train_dataset=data, processing_class=tok)


@pytest.mark.parametrize("checkpointing,bf16", [(False, False), (True, False), (False, True)])
def test_training_step_through_the_trainer(tmp_path, monkeypatch, checkpointing, bf16):
    """A user's LoRA step: the trainer's loss forward and backward run the fused layers (the backward's recomputed
    forward too, under gradient checkpointing; under the autocast of ``bf16=True``), and the step moves the adapters
    as PEFT's layers would (plain SGD, so a difference in a gradient shows in the weights as it is)."""
    model, tok = _lora_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    twin = copy.deepcopy(model)

    count = _Counting(monkeypatch)
    _trainer(tmp_path / "fused", model, tok, gradient_checkpointing=checkpointing, bf16=bf16).train()
    layers = len(lora_layers(model))
    assert count.backward >= layers  # (the shared prompt's forward and the completions' forward: a node each)
    assert count.forward >= count.backward * (2 if checkpointing else 1)  # under checkpointing: and the recompute
    assert count.dtypes == {torch.bfloat16 if bf16 else torch.float32}  # bf16=True: autocast's dtype

    for module in (grpokit.forward.logprobs, grpokit.trainer):
        monkeypatch.setattr(module, "fused_lora", lambda model: contextlib.nullcontext(0))
    _trainer(tmp_path / "peft", twin, tok, gradient_checkpointing=checkpointing, bf16=bf16).train()

    moved = 0
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if name in start:
            torch.testing.assert_close(p, q, **(dict(rtol=1e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)))
            moved += int(not torch.equal(p, start[name]))
    assert moved == len(start)  # every adapter matrix moved


def test_calls_left_to_peft(monkeypatch):
    """Dropout that acts, disabled or merged adapters: PEFT's forward, with PEFT's result to the bit."""
    count = _Counting(monkeypatch)
    x = torch.randn(3, 5, 32)

    def compare(model, x, **tol):
        with torch.no_grad():
            with fused_lora(model):
                got = model(inputs_embeds=x).logits
            want = model(inputs_embeds=x).logits
        torch.testing.assert_close(got, want, **(tol or dict(rtol=0, atol=0)))

    model, _ = _lora_model(lora_dropout=0.5)
    model.train()
    torch.manual_seed(0)
    with fused_lora(model):
        model(inputs_embeds=x)
    assert count.forward == 0  # dropout acts in training mode
    with model.disable_adapter():  # the reference model of a LoRA run
        compare(model, x)
    model.merge_adapter()
    compare(model, x)
    model.unmerge_adapter()
    assert count.forward == 0
    model.eval()
    compare(model, x, rtol=1e-5, atol=1e-6)
    assert count.forward == len(lora_layers(model))  # dropout does not act in eval mode: fused


def _layer_step(model, layer, x, autocast=False):
    """One LoRA layer's output and the gradients of x, A and B for a fixed weighting of its outputs."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), x.grad.clone(), layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad


def test_under_autocast(monkeypatch):
    """Under autocast (the trainer's bf16=True) every operand is cast to bf16, as autocast casts PEFT's three linear
    layers: the same values and gradients up to bf16 rounding, the float32 adapters' gradients float32."""
    model, _ = _lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, 32, requires_grad=True)

    count = _Counting(monkeypatch)
    with fused_lora(model):
        fused = _layer_step(model, layer, x, autocast=True)
    assert count.forward == 1 and count.backward == 1
    peft = _layer_step(model, layer, x, autocast=True)
    assert fused[0].dtype == peft[0].dtype == torch.bfloat16
    assert fused[2].dtype == fused[3].dtype == torch.float32
    for got, want in zip(fused, peft):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bf16_base_with_float32_adapters(monkeypatch):
    """PEFT's default over a bf16 model (the demo's on a CPU that multiplies bf16): the adapters stay float32, the
    input is cast to theirs and the sum back to bf16; fused, the same values and gradients up to bf16 rounding."""
    model, tok = _lora_model()
    for layer in lora_layers(model):
        layer.base_layer.to(torch.bfloat16)
    layer = model.base_model.model.model.layers[0].mlp.gate_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)

    count = _Counting(monkeypatch)
    with fused_lora(model):
        fused = _layer_step(model, layer, x)
    assert count.forward == 1 and count.backward == 1 and fused[0].dtype == torch.bfloat16
    peft = _layer_step(model, layer, x)
    torch.testing.assert_close(fused[0], peft[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused[1], peft[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused[2], peft[2], rtol=1e-4, atol=1e-5)  # float32 sums of the same bf16 products
    torch.testing.assert_close(fused[3], peft[3], rtol=1e-4, atol=1e-5)


def test_a_copy_made_inside_computes_with_its_own_weights():
    model, _ = _lora_model()
    x = torch.randn(2, 3, 32)
    with torch.no_grad(), fused_lora(model):
        twin = copy.deepcopy(model)
        for layer in lora_layers(twin):
            layer.lora_B["default"].weight.mul_(2)
        theirs, ours = twin(inputs_embeds=x).logits, model(inputs_embeds=x).logits
    assert not torch.allclose(theirs, ours)
    with torch.no_grad():
        torch.testing.assert_close(ours, model(inputs_embeds=x).logits)
