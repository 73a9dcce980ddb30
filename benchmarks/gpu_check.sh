#!/usr/bin/env bash
# One real vLLM colocate GRPO run of two steps on one CUDA GPU: generation by vLLM, the sampler/trainer mismatch
# correction (VESPO folds the token-level ratio into its weight), and the weight sync after the first step;
# the dapo run also sleeps the engine between generations (vllm_enable_sleep_mode).
# Needs a GPU machine with `pip install -e '.[vllm]'` done. Prints the logged metrics and exits non-zero on failure.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import math
import torch
from grpokit import GRPOConfig, GRPOTrainer
from grpokit.tasks import get_task

assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU"
task = get_task("arithmetic")
for loss_type, mode, sleep in [("vespo", "token_truncate", False), ("dapo", "sequence_mask", True)]:
    args = GRPOConfig(
        output_dir=f"/tmp/gpu_check_{loss_type}", use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3, vllm_importance_sampling_mode=mode, loss_type=loss_type,
        vllm_enable_sleep_mode=sleep,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=64, max_steps=2,
        logging_steps=1, learning_rate=1e-5, report_to="none", save_strategy="no", gradient_checkpointing=False,
    )
    trainer = GRPOTrainer("smollm2-135m-instruct", task.reward_funcs, args=args, train_dataset=task.train_dataset)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2, logs
    for h in logs:
        print(loss_type, {k: round(v, 4) for k, v in h.items() if isinstance(v, float)})
        assert math.isfinite(h["loss"]) and "sampling/importance_sampling_ratio/mean" in h
        assert h["sampling/sampling_logp_difference/mean"] < 0.5, "vLLM and the trainer disagree badly"
print("gpu_check: OK")
PY
