"""Mixed precision reaches the LM head in the path users run: GRPOTrainer with bf16=True (accelerate wraps the
model's forward in autocast; the chunked head projects after that forward has returned) runs the head's matmuls in
bf16, forward and recomputed backward, and its log-probs are the plain bf16 logits' ones."""

from __future__ import annotations

import torch
from conftest import FixedRollout
from runs import chat_dataset, make_args, varied_reward
from tiny import tiny_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.forward.logprobs import completion_logps
from grpokit.trainer import GRPOTrainer

VOCAB = 4096 + 300  # more than one vocabulary tile of the CPU blocks (4096)
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class MatmulDtypes(TorchDispatchMode):
    """Every matmul run inside the block: (dtype of its operands, FLOPs, whether it touches the vocabulary)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[torch.dtype, int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            a, b = (args[1], args[2]) if func == torch.ops.aten.addmm.default else (args[0], args[1])
            flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
            vocab = any(d in (4096, 300, VOCAB) for d in (*a.shape, *b.shape))
            self.ops.append((a.dtype, flops, vocab))
        return out


def test_bf16_reaches_the_head_inside_the_trainer(tmp_path):
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    record = MatmulDtypes()

    class Recorded(GRPOTrainer):  # one optimizer step's forward and backward, as transformers runs them
        def training_step(self, *args, **kwargs):
            with record:
                return super().training_step(*args, **kwargs)

    trainer = Recorded(model, varied_reward, args=make_args(tmp_path, bf16=True, max_steps=1, loss_type="dapo"),
                       train_dataset=chat_dataset(), processing_class=tok, rollout_backend=FixedRollout(tok))
    trainer.train()
    head = [(dtype, flops) for dtype, flops, vocab in record.ops if vocab]
    assert head and all(dtype == torch.bfloat16 for dtype, _ in head), {d for d, _ in head}
    total = sum(f for _, f, _ in record.ops)
    assert sum(f for d, f, _ in record.ops if d == torch.bfloat16) / total > 0.99

    # the values: the lean head's log-probs through the trainer's (autocast-wrapped) model are the bf16 logits' ones
    ids = tok([tok.apply_chat_template(chat_dataset()[0]["prompt"], tokenize=False, add_generation_prompt=True)],
              return_tensors="pt", add_special_tokens=False)["input_ids"].repeat(4, 1)
    completion = torch.randint(10, 200, (4, 6), generator=torch.Generator().manual_seed(1))
    masks = (torch.ones_like(ids), torch.ones_like(completion))
    with torch.no_grad():
        lean, _ = completion_logps(trainer.model, ids, masks[0], completion, masks[1])
        plain, _ = completion_logps(trainer.model, ids, masks[0], completion, masks[1], lean=False)
        plain_model = LlamaForCausalLM(trainer.model.config)  # the same weights, its forward not wrapped: float32
        plain_model.load_state_dict(trainer.model.state_dict())
        exact, _ = completion_logps(plain_model, ids, masks[0], completion, masks[1], lean=False)
    torch.testing.assert_close(lean, plain, atol=0.03, rtol=0)
    assert (lean - exact).abs().max() > 1e-4  # bf16 indeed: not the float32 values
