"""The pipeline's finishing stage: scored samples in, the batch the loss takes out (:class:`grpokit.batch.RolloutBatch`)
with its statistics. Advantages need whole groups, so every process's rewards are gathered: this stage makes
collectives and runs in the learner's thread."""

from __future__ import annotations

import torch

from ..algorithms.advantages import group_advantages
from ..algorithms.importance import SamplerCorrection
from ..algorithms.masked import nanstd
from ..algorithms.sampling_support import SamplingSupport
from ..batch import RolloutBatch
from .driver import FinishingDriver
from .samples import ScoredSamples
from .stats import RolloutStats


class BatchFinisher:
    """``reward_names`` / ``reward_weights``: one per reward column. ``reuses_batches``: a generation batch serves
    several optimizer steps (``num_iterations`` > 1 or ``steps_per_generation`` > gradient accumulation), so the
    loss needs the log-probs of the policy that generated it. ``support``: what the sampler does to its distribution
    (its settings and stop tokens), replayed on the trainer's log-probs for the mismatch."""

    def __init__(self, args, reward_names: list[str], reward_weights: torch.Tensor, reuses_batches: bool,
                 support: SamplingSupport | None = None):
        self.args, self.reward_names, self.reward_weights = args, reward_names, reward_weights
        self.reuses_batches = reuses_batches
        self.support = support or SamplingSupport.from_config(args)

    def __call__(self, s: ScoredSamples, driver: FinishingDriver, mode: str, stats: RolloutStats,
                 behaviour_logps: torch.Tensor | None = None,
                 behaviour_routes: torch.Tensor | None = None,
                 behaviour_support_logps: torch.Tensor | None = None) -> RolloutBatch:
        """Advantages over every process's groups, the loss mask, the log-probs the loss needs (``behaviour_logps``:
        the generating policy's, when that is not the current one, ``behaviour_routes`` the experts its forward used
        and ``behaviour_support_logps`` its log-probs under the sampler's distribution), and the batch's metrics
        into ``stats``."""
        a, device = self.args, driver.device
        driver.stop_together(s.incidents.stop_cause)  # a stop a user-code timeout asked for: every process, together
        self._reduce_reward_logs(stats, driver)
        gen = s.generation
        completion_mask = gen.completion_mask.to(device)
        truncated = gen.is_truncated.to(device)
        rewards_local = s.rewards.to(device)
        rewards, result, advantages = self._advantages(rewards_local, driver, mode)
        if a.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        batch = RolloutBatch(
            prompt_ids=s.prompt_ids.to(device), prompt_mask=s.prompt_mask.to(device),
            completion_ids=gen.completion_ids.to(device), completion_mask=completion_mask, advantages=advantages,
            num_items_in_batch=torch.zeros(()),
            sampler_logps=gen.sampler_logps.to(device) if gen.sampler_logps is not None else None,
            tool_mask=gen.tool_mask.to(device) if gen.tool_mask is not None else None,
            vision=s.vision.to(device) if s.vision is not None else None,
        )
        if gen.prompt_routes is not None:  # a Mixture-of-Experts sampler's experts, kept on the CPU
            batch.sampler_routes = torch.cat([gen.prompt_routes, gen.completion_routes], 1)
        batch.num_items_in_batch = driver.gather(batch.loss_mask.sum().reshape(1)).sum()
        if behaviour_logps is not None:
            batch.old_logps = behaviour_logps.to(device)
            batch.old_routes = behaviour_routes
        self._add_logps(batch, driver, mode, stats,
                        None if behaviour_support_logps is None else behaviour_support_logps.to(device))
        lengths_local = (gen.completion_mask if gen.tool_mask is None else gen.completion_mask * gen.tool_mask).sum(1)
        self._rollout_metrics(stats, driver, mode, rewards, result, lengths_local.to(device), truncated, s.prompt_mask,
                              batch.loss_mask)
        stats.samples = {
            "prompt": s.prompt_texts, "completion": s.completion_texts, "advantage": advantages.tolist(),
            "rewards": {name: rewards_local[:, k].tolist() for k, name in enumerate(self.reward_names)},
            "extra": s.extra_columns,
        }
        if s.images is not None and a.log_multimodal:  # the completions table's image column (TRL's)
            stats.samples["images"] = s.images
        return batch

    def _reduce_reward_logs(self, stats: RolloutStats, driver: FinishingDriver) -> None:
        """What reward functions logged for this batch, averaged over every process: every process takes part for
        every name any process used."""
        pending, stats.reward_logs = stats.reward_logs, {}
        names = sorted(pending)
        if driver.num_processes > 1:
            names = sorted(set().union(*driver.gather_objects([names])))
        for name in names:
            values = pending.get(name, [])
            totals = driver.sum_over_processes(torch.tensor([sum(values), float(len(values))], device=driver.device))
            if totals[1] > 0:
                stats.add(name, (totals[0] / totals[1]).item())

    def _advantages(self, rewards_local: torch.Tensor, driver: FinishingDriver, mode: str):
        """Every process's rewards gathered, advantages computed, this process's slice kept. Returns ``(all rewards,
        the AdvantageResult, this process's advantages)``."""
        a = self.args
        rewards = driver.gather(rewards_local)
        g = a.num_generations if mode == "train" else (a.num_generations_eval or a.num_generations)
        result = group_advantages(
            rewards, g, reward_weights=self.reward_weights.to(rewards.device), scale_rewards=a.scale_rewards,
            multi_objective_aggregation=a.multi_objective_aggregation, advantage_estimator=a.advantage_estimator,
        )
        n, rank = rewards_local.shape[0], driver.process_index
        return rewards, result, result.advantages[rank * n:(rank + 1) * n].to(driver.device)

    def _add_logps(self, batch: RolloutBatch, driver: FinishingDriver, mode: str, stats: RolloutStats,
                   behaviour_on_support: torch.Tensor | None = None) -> None:
        """The log-probs the loss needs besides the current policy's: the rollout policy's (``old_logps``) when the
        batch is reused across optimizer steps, or when the sampler is not the trainer and its correction needs them
        before the training forward (a Mixture-of-Experts policy replaying routes); the reference model's when
        ``beta != 0``; and the sampler/trainer mismatch ratio with its metrics where ``old_logps`` were computed.

        A batch used once, on the policy that trains on it, keeps ``old_logps`` None even when a sampler's own
        log-probs came with it: the loss's forward is then that policy, and the loss computes the mismatch from it
        (:meth:`grpokit.GRPOTrainer.compute_loss`), one forward fewer per step. A sampler that truncates (``top_k``,
        ``top_p``, ``min_p``) reports log-probs renormalised over what it kept: the mismatch compares them with the
        trainer's on that same support (docs/algorithms.md §5), from the same forward."""
        a = self.args
        ids = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        images = {} if batch.vision is None else {"vision": batch.vision}  # a driver without images never sees them
        support = self.support
        on_support: list | None = [] if batch.sampler_logps is not None and support.reshapes else None
        with torch.no_grad():
            reused = mode == "train" and self.reuses_batches
            replays = a.routing_replay != "none"
            if batch.old_logps is None and (reused or (batch.sampler_logps is not None and replays)):
                routing, recorded = self._routing(batch)
                if on_support is not None:
                    routing.update(support=support, on_support=on_support)
                batch.old_logps = driver.policy_logps(*ids, **images, **routing)
                batch.old_routes = recorded[0] if recorded else None
            if a.beta != 0.0:
                batch.ref_logps = driver.reference_logps(*ids, **images)
        if batch.sampler_logps is None or batch.old_logps is None:
            return
        if on_support is not None and not on_support:  # old log-probs from a producer: its replay, when it made one
            on_support = [behaviour_on_support] if behaviour_on_support is not None else None
        trainer_logps = on_support[0] if on_support else batch.old_logps  # on the sampler's support
        batch.sampler_ratio, metrics = SamplerCorrection.from_config(a)(trainer_logps, batch.sampler_logps,
                                                                         batch.loss_mask)
        for name, value in metrics.items():
            stats.add(f"sampling/{name}", value)

    def _routing(self, batch: RolloutBatch) -> tuple[dict, list]:
        """What the old log-probs' forward of a Mixture-of-Experts policy does with its routing — records it into the
        list returned (``routing_replay="old"``: the training forward replays it), or forces the sampler's experts
        (``"rollout"``: old and training forward route alike, so the policy ratio measures the update and not a
        routing flip) — as ``policy_logps``'s keyword arguments."""
        recorded: list = []
        if self.args.routing_replay == "old":
            return {"record_routes": recorded}, recorded
        if self.args.routing_replay == "rollout" and batch.sampler_routes is not None:
            return {"force_routes": batch.sampler_routes}, recorded
        return {}, recorded

    def _rollout_metrics(self, stats: RolloutStats, driver: FinishingDriver, mode: str, rewards, result, lengths_local,
                         truncated, prompt_mask, completion_mask) -> None:
        lengths = driver.gather(lengths_local).float()
        trunc = driver.gather(truncated.float())
        if mode == "train":
            stats.tokens = int(driver.gather((prompt_mask.sum() + completion_mask.sum()).reshape(1)).sum())
        stats.add("completions/mean_length", lengths.mean().item())
        stats.add("completions/min_length", lengths.min().item())
        stats.add("completions/max_length", lengths.max().item())
        stats.add("completions/clipped_ratio", trunc.mean().item())
        done = lengths[trunc == 0]
        if done.numel():
            stats.add("completions/mean_terminated_length", done.mean().item())
            stats.add("completions/min_terminated_length", done.min().item())
            stats.add("completions/max_terminated_length", done.max().item())
        for k, name in enumerate(self.reward_names):
            col = rewards[:, k]
            if (~torch.isnan(col)).any():
                stats.add(f"rewards/{name}/mean", torch.nanmean(col).item())
                stats.add(f"rewards/{name}/std", nanstd(col).item())
        total = result.weighted  # the raw rewards weighted, as TRL logs them (not the normalised sum)
        stats.add("reward", torch.nanmean(total).item())  # NaN when no row was scored: dropped at log time, never 0
        stats.add("reward_std", nanstd(total).item())
        stats.add("frac_reward_zero_std", result.zero_std.float().mean().item())
