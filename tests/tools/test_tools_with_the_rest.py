"""Tools with the rest of the trainer: the vLLM backend generating across tool turns (a fake engine), sequence-level
and off-policy losses with LoRA and gradient accumulation, and a checkpointed run resumed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from scripted_tools import ScriptedBackend, add, args_for, dataset, tokenizer, used_tool
from tiny import tiny_model

from grpokit.rollout.vllm_backend import VLLMRollout
from grpokit.trainer import GRPOTrainer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ToolCallingLLM:
    """vllm.LLM's surface: rows whose prompt has no tool result yet call ``add`` (even rows) or answer; rows after a
    tool result answer. Every token's log-prob is -0.25."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, prompts, sampling_params, use_tqdm):
        self.prompts.append([p["prompt_token_ids"] for p in prompts])
        outs = []
        for i, p in enumerate(prompts):
            after_tool = "<tool_response>\n" in self.tok.decode(p["prompt_token_ids"])
            text = "Answer: 5" if after_tool or i % 2 else CALL
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            ids = ids[:sampling_params["max_tokens"]]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-0.25)} for t in ids], finish_reason="stop")]))
        return outs

    def reset_prefix_cache(self):
        pass


def test_vllm_generates_across_tool_turns_with_its_log_probs_on_the_model_tokens(tmp_path):
    tok = tokenizer()
    llm = ToolCallingLLM(tok)
    args = args_for(tmp_path, use_vllm=True, vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(tiny_model(tok, max_positions=2048), used_tool, args=args, train_dataset=dataset(),
                          processing_class=tok, tools=[add],
                          rollout_backend=VLLMRollout("unused", tok, args, llm=llm, sampling_params_cls=dict))
    batch, _ = trainer.pipeline.next_batch([dataset()[0]] * 4, trainer.driver)
    first, second = llm.prompts[0], llm.prompts[1]
    assert len(second) == 2  # the two rows that called the tool continue
    for j, row in enumerate((0, 2)):
        reply = first[row]
        text = tok.decode(second[j][len(reply):])
        assert second[j][:len(reply)] == reply  # the prompt, unchanged, then the reply and the tool turn
        assert tok.decode(second[j]).count(CALL) == 1 and "<tool_response>\n5\n</tool_response>" in text
        assert text.endswith("<|im_start|>assistant\n")
    tool, valid = batch.tool_mask.bool(), batch.completion_mask.bool()
    assert (~tool[0::2] & valid[0::2]).any() and tool[1::2].all()
    own = tool & valid
    assert (batch.sampler_logps[own] == -0.25).all() and (batch.sampler_logps[~own] == 0).all()
    # the tool turn's tokens carry no weight: the correction on them is irrelevant, the loss never sees them
    assert batch.loss_mask[~own].sum() == 0


@pytest.mark.parametrize("loss_type,level,ga,lora", [("grpo", "sequence", 2, True), ("vespo", "sequence", 1, False),
                                                     ("cispo", "token", 2, False), ("dr_grpo", "sequence_token", 1, True)])
def test_tools_train_with_losses_levels_lora_and_accumulation(tmp_path, loss_type, level, ga, lora):
    from peft import LoraConfig

    tok = tokenizer()
    model = tiny_model(tok, max_positions=2048)
    args = args_for(tmp_path, loss_type=loss_type, importance_sampling_level=level, gradient_accumulation_steps=ga,
                    per_device_train_batch_size=4 // ga, max_steps=1, num_iterations=2)
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]) if lora else None
    trainer = GRPOTrainer(model, used_tool, args=args, train_dataset=dataset(), processing_class=tok, tools=[add],
                          rollout_backend=ScriptedBackend(tok), peft_config=peft_config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    log = [h for h in trainer.state.log_history if "reward" in h][0]
    assert log["tools/call_frequency"] > 0 and torch.isfinite(torch.tensor(log["loss"]))
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and (not lora or all("lora_" in n for n in moved))


def test_a_tools_run_resumes_from_its_checkpoint(tmp_path):
    tok = tokenizer()
    args = args_for(tmp_path, save_strategy="steps", save_steps=1, max_steps=2, seed=3)
    trainer = GRPOTrainer(tiny_model(tok, max_positions=2048), used_tool, args=args, train_dataset=dataset(),
                          processing_class=tok, tools=[add], rollout_backend=ScriptedBackend(tok))
    trainer.train()
    full = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    resumed = GRPOTrainer(tiny_model(tok, max_positions=2048), used_tool, args=args, train_dataset=dataset(),
                          processing_class=tok, tools=[add], rollout_backend=ScriptedBackend(tok))
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-1"))
    assert resumed.state.global_step == 2
    for n, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, full[n])  # the scripted replies repeat: the same second step
