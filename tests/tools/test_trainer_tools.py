"""GRPOTrainer with tools=, environment_factory= and rollout_func= (TRL 1.16's interface), on a tiny model: tool turns
masked out of the loss with the model's own log-probs exact, TRL's tool metrics, environments chosen per row with
their rewards, rollout_func's fields, and a TRL script with tools running under both packages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from scripted_tools import Counter, ScriptedBackend, add, args_for, dataset, tokenizer, used_tool
from tiny import tiny_model, tiny_tokenizer

from grpokit.forward.logprobs import completion_logps
from grpokit.trainer import GRPOTrainer

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


def model_for(tok):
    """A tiny model with room for the tools' system prompt and a few turns."""
    return tiny_model(tok, max_positions=2048)


def test_tool_turns_are_masked_and_the_model_tokens_log_probs_are_exact(tmp_path):
    tok = tokenizer()
    model = model_for(tok)
    trainer = GRPOTrainer(model, used_tool, args=args_for(tmp_path), train_dataset=dataset(), processing_class=tok,
                          tools=[add], rollout_backend=ScriptedBackend(tok))
    seen = []
    compute = trainer.compute_loss

    def spy(m, inputs, **kw):
        seen.append(inputs)
        return compute(m, inputs, **kw)

    trainer.compute_loss = spy
    trainer.train()
    batch = seen[0]
    assert batch.tool_mask is not None
    assert (batch.tool_mask[0::2] == 0).any() and (batch.tool_mask[1::2] == 1).all()  # even rows called the tool
    assert torch.equal(batch.loss_mask, batch.completion_mask * batch.tool_mask)
    assert batch.num_items_in_batch == batch.loss_mask.sum()
    # the model's own tokens' log-probs: a plain forward over prompt + the whole completion (tool turn as context)
    with torch.no_grad():
        lp, _ = completion_logps(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                 batch.completion_mask, lean=False)
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        am = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        P = batch.prompt_ids.shape[1]
        ref = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, batch.completion_ids.unsqueeze(-1))[..., 0]
    valid = batch.loss_mask.bool()
    torch.testing.assert_close(lp[valid], ref[valid], rtol=1e-5, atol=1e-5)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert logs[0]["tools/call_frequency"] == 0.5 and logs[0]["tools/failure_frequency"] == 0.0
    assert logs[0]["rewards/used_tool/mean"] == 0.5
    # lengths count the model's tokens only (TRL): the tool turn is not in them
    assert logs[0]["completions/max_length"] == batch.loss_mask.sum(1).max()


def test_a_template_without_tools_is_refused_before_training(tmp_path):
    tok = tiny_tokenizer()  # plain ChatML: no tools rendered
    with pytest.raises(ValueError, match="does not render tool calls.*CHATML_TOOLS_TEMPLATE"):
        GRPOTrainer(model_for(tok), used_tool, args=args_for(tmp_path), train_dataset=dataset(), processing_class=tok,
                    tools=[add])


def test_undocumented_tools_are_refused_before_the_model_loads(tmp_path):
    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="tool 'undocumented' cannot be described to the model"):
        GRPOTrainer("/nonexistent/model", used_tool, args=args_for(tmp_path), train_dataset=dataset(),
                    tools=[undocumented])


class Echo:
    def reset(self, **row):
        self.said = ""
        return None

    def say(self, text: str) -> str:
        """Say something.

        Args:
            text: what to say
        """
        self.said = text
        return text


def test_environments_per_row_their_tools_and_rewards(tmp_path):
    tok = tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(8)],
                            "environment": ["counter", "echo"] * 4, "target": [5] * 8})
    call = '<tool_call>{"name": "increment", "arguments": {"by": 5}}</tool_call>'
    backend = ScriptedBackend(tok, first=lambda i: call if i in (0, 1) else "done")
    trainer = GRPOTrainer(model_for(tok), None,
                          args=args_for(tmp_path, shuffle_dataset=False, max_steps=1, per_device_train_batch_size=8),
                          train_dataset=ds, processing_class=tok, rollout_backend=backend,
                          environment_factory={"counter": Counter, "echo": Echo})
    assert trainer.reward_func_names == ["Counter"]  # the only get_reward; reward_funcs may be omitted
    prompts = []
    score = trainer.pipeline.scorer

    def spy(rows, driver, stats):
        s = score(rows, driver, stats)
        prompts.append(s.prompt_texts)
        return s

    trainer.pipeline.scorer = spy
    trainer.train()
    texts = prompts[0]
    assert "Go 0. Reach 5." in texts[0] and '"name": "increment"' in texts[0] and '"name": "say"' not in texts[0]
    assert '"name": "say"' in texts[4] and "Reach" not in texts[4]  # the echo environment: its own tool, no reset text
    log = [h for h in trainer.state.log_history if "reward" in h][0]
    # rows 0 and 1 incremented their counters to the target; counters of rows 2, 3 did not; echo rows: not applicable
    assert log["rewards/Counter/mean"] == pytest.approx(0.5)
    assert log["tools/call_frequency"] == pytest.approx(2 / 8)


def test_environment_without_dataset_needs_max_steps(tmp_path):
    tok = tokenizer()
    with pytest.raises(ValueError, match="max_steps=-1 is not allowed without a train_dataset"):
        GRPOTrainer(model_for(tok), None, args=args_for(tmp_path, max_steps=-1), processing_class=tok,
                    environment_factory=Counter)
    with pytest.raises(ValueError, match="No reward source provided: pass reward_funcs"):
        GRPOTrainer(model_for(tok), None, args=args_for(tmp_path), train_dataset=dataset(), processing_class=tok)
    with pytest.raises(ValueError, match="`train_dataset` is required: pass a train_dataset, or an environment_factory"):
        GRPOTrainer(model_for(tok), lambda completions, **kw: [0.0] * len(completions), args=args_for(tmp_path),
                    processing_class=tok)  # checked at construction (as TRL), not when train() starts


def test_environment_makes_its_own_prompts(tmp_path):
    class Guess:
        def reset(self, **row):
            return "Guess a number."

        def get_reward(self) -> float:
            return 0.5

    tok = tokenizer()
    trainer = GRPOTrainer(model_for(tok), None, args=args_for(tmp_path, max_completion_length=6), processing_class=tok,
                          environment_factory=Guess)
    trainer.train()
    assert trainer.state.global_step == 2
    assert [h for h in trainer.state.log_history if "reward" in h][0]["rewards/Guess/mean"] == 0.5


def test_rollout_func_fields_and_env_mask(tmp_path):
    tok = tiny_tokenizer()
    calls = []

    def rollout(prompts, trainer):
        calls.append(list(prompts))
        ids = [tok(p[0]["content"], add_special_tokens=False)["input_ids"] for p in prompts]
        completion = [[30, 31, 32, tok.eos_token_id]] * len(prompts)
        return {"prompt_ids": ids, "completion_ids": completion, "logprobs": [[-1.0] * 4] * len(prompts),
                "env_mask": [[1, 0, 0, 1]] * len(prompts), "label": [f"L{i}" for i in range(len(prompts))],
                "shared": 7}

    seen = {}

    def reward(completions, label, shared, **kw):
        seen.update(label=list(label), shared=list(shared))
        return [float(i) for i in range(len(completions))]

    trainer = GRPOTrainer(model_for(tok), reward, args=args_for(tmp_path, max_steps=1), train_dataset=dataset(),
                          processing_class=tok, rollout_func=rollout)
    batches = []
    compute = trainer.compute_loss
    trainer.compute_loss = lambda m, inputs, **kw: (batches.append(inputs), compute(m, inputs, **kw))[1]
    trainer.train()
    assert len(calls[0]) == 4 and calls[0][0] == calls[0][3]  # one prompt, num_generations times
    assert seen["label"] == ["L0", "L1", "L2", "L3"] and seen["shared"] == [7] * 4
    b = batches[0]
    assert b.completion_ids[0].tolist() == [30, 31, 32, tok.eos_token_id]
    assert b.loss_mask[0].tolist() == [1, 0, 0, 1] and b.sampler_logps is None  # logprobs: only with use_vllm


def test_rollout_func_without_a_required_key_is_one_clear_error(tmp_path):
    tok = tiny_tokenizer()

    def rollout(prompts, trainer):  # no logprobs
        return {"prompt_ids": [[5]] * len(prompts), "completion_ids": [[6, tok.eos_token_id]] * len(prompts)}

    trainer = GRPOTrainer(model_for(tok), lambda completions, **kw: [0.0] * len(completions),
                          args=args_for(tmp_path, max_steps=1), train_dataset=dataset(), processing_class=tok,
                          rollout_func=rollout)
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\] in its output dict"):
        trainer.train()


TRL_TOOLS_SCRIPT = '''
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b

tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
tokenizer.chat_template = TEMPLATE
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(8)]})

def reward(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]

args = GRPOConfig(output_dir=OUTPUT_DIR, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                  max_tool_calling_iterations=2, gradient_checkpointing=False)
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(MODEL_DIR), reward_funcs=reward, args=args,
                      train_dataset=dataset, processing_class=tokenizer, tools=[add])
trainer.train()
'''


def test_a_trl_tools_script_runs_under_both(tiny_dir, tmp_path):
    template = (TRL_TEMPLATES / "qwen2_5.jinja").read_text()
    for package in ("trl", "grpokit"):
        scope = {"MODEL_DIR": str(tiny_dir), "OUTPUT_DIR": str(tmp_path / package), "TEMPLATE": template}
        source = TRL_TOOLS_SCRIPT.replace("from trl import", f"from {package} import")
        exec(compile(source, "trl_tools_script.py", "exec"), scope)  # test code: the user's script
        logs = [h for h in scope["trainer"].state.log_history if "reward" in h]
        assert len(logs) == 2 and all("tools/call_frequency" in h for h in logs), package
        assert type(scope["trainer"]).__module__.startswith(package)
