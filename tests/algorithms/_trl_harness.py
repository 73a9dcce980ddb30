"""Call TRL 1.16's ``GRPOTrainer._compute_loss`` without a model or a trainer.

``_compute_loss`` is taken off the class and called on a minimal stand-in for ``self``: its
``_get_per_token_logps_and_entropies`` hands back the log-prob tensor we give it, and it carries just the
attributes the method reads. One process: ``gather``/``reduce`` are the identity, ``num_processes`` is only
the number the dapo-family normaliser divides by.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch
from trl.trainer.grpo_trainer import GRPOTrainer


class _Accelerator:
    def __init__(self, num_processes: int = 1):
        self.num_processes = num_processes
        self.process_index = 0
        self.sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_loss(
    logps: torch.Tensor, old_logps, advantages, mask, *, loss_type, importance_sampling_level="token", epsilon=0.2,
    epsilon_high=None, delta=None, beta=0.0, ref_logps=None, use_bias_correction_kl=False, entropies=None,
    top_entropy_quantile=1.0, off_policy_mask_threshold=None, sampler_logps=None, importance_sampling_ratio=None,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, max_completion_length=None, num_items_in_batch=None, gradient_accumulation_steps=1,
    steps_per_generation=1, num_processes=1,
):
    """TRL's loss for one micro-batch; returns ``(loss, logps leaf with .grad after backward, metrics dict)``."""
    B, T = logps.shape
    x = logps.detach().clone().requires_grad_(True)
    ent = entropies if entropies is not None else torch.zeros_like(logps)
    fake = types.SimpleNamespace()
    fake._get_per_token_logps_and_entropies = lambda model, *a, **k: (x, ent, None)
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    fake.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    fake.loss_type = loss_type
    fake.importance_sampling_level = importance_sampling_level
    fake.epsilon_low = epsilon
    fake.epsilon_high = epsilon_high if epsilon_high is not None else epsilon
    fake.beta = beta
    fake.top_entropy_quantile = top_entropy_quantile
    fake.off_policy_mask_threshold = off_policy_mask_threshold
    fake.use_vllm = importance_sampling_ratio is not None
    fake.vllm_importance_sampling_correction = importance_sampling_ratio is not None
    fake.current_gradient_accumulation_steps = gradient_accumulation_steps
    fake.max_completion_length = max_completion_length if max_completion_length is not None else T
    fake.accelerator = _Accelerator(num_processes)
    fake.model = types.SimpleNamespace(training=True)
    fake._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fake.aux_loss_enabled = False
    fake._entropy_bonus_enabled = False
    fake.args = types.SimpleNamespace(
        delta=delta, use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, steps_per_generation=steps_per_generation,
    )
    int_mask = mask.to(torch.long)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": int_mask,
        "advantages": advantages,
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if sampler_logps is not None:
        inputs["sampling_per_token_logps"] = sampler_logps
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    n = num_items_in_batch if num_items_in_batch is not None else mask.sum()
    inputs["num_items_in_batch"] = torch.as_tensor(n, dtype=logps.dtype)
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    return loss, x, metrics


def trl_advantages(rewards_per_func: torch.Tensor, num_generations: int, *, reward_weights=None,
                   scale_rewards="group", multi_objective_aggregation="sum_then_normalize") -> torch.Tensor:
    """TRL 1.16's advantage formula (``GRPOTrainer._generate_and_score_completions``), restated with its own
    ``nanstd`` so that it can run without a trainer. Test-only."""
    from trl.trainer.utils import nanstd

    n, k = rewards_per_func.shape
    w = torch.ones(k, dtype=rewards_per_func.dtype) if reward_weights is None else torch.as_tensor(
        reward_weights, dtype=rewards_per_func.dtype)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    g = num_generations
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, g, k)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, k)
        rewards = (reward_k * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)
