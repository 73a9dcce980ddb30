"""A script written for TRL runs after changing only the import (TRL's own quick-start shape)."""

import pytest

TRL_SCRIPT = '''
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

dataset = Dataset.from_dict({
    "prompt": [[{"role": "user", "content": f"Write a short poem about {w}."}] for w in
               ["rain", "sun", "wind", "snow", "fog", "hail", "frost", "dew"]],
    "topic": ["rain", "sun", "wind", "snow", "fog", "hail", "frost", "dew"],
})

def reward_len(completions, **kwargs):
    return [-abs(6 - len(completion[0]["content"])) for completion in completions]

def mentions_topic(completions, topic, **kwargs):
    return [1.0 if t in c[0]["content"] else 0.0 for c, t in zip(completions, topic)]

training_args = GRPOConfig(
    output_dir=OUTPUT_DIR, logging_steps=1, per_device_train_batch_size=4, num_generations=4,
    max_completion_length=8, max_steps=2, report_to="none", use_cpu=True, save_strategy="no",
    loss_type="dr_grpo", scale_rewards="batch", reward_weights=[1.0, 0.5], beta=0.04,
)
trainer = GRPOTrainer(
    model=MODEL_DIR,
    reward_funcs=[reward_len, mentions_topic],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''


@pytest.fixture
def model_dir(tiny_dir):
    return str(tiny_dir)


def run(source: str, model_dir: str, out: str) -> dict:
    scope = {"MODEL_DIR": model_dir, "OUTPUT_DIR": out}
    exec(compile(source, "trl_script.py", "exec"), scope)  # test code: runs the user's script, not model output
    return scope


def test_script_runs_under_trl_and_under_grpokit(model_dir, tmp_path):
    pytest.importorskip("trl")
    trl_scope = run(TRL_SCRIPT, model_dir, str(tmp_path / "trl"))  # the script is a genuine TRL script
    ours = run(TRL_SCRIPT.replace("from trl import", "from grpokit import"), model_dir, str(tmp_path / "ours"))
    assert type(ours["trainer"]).__module__ == "grpokit.trainer"
    for scope in (trl_scope, ours):
        logs = [h for h in scope["trainer"].state.log_history if "reward" in h]
        assert len(logs) == 2
        assert {"rewards/reward_len/mean", "rewards/mentions_topic/mean", "kl", "reward_std"} <= set(logs[0])
