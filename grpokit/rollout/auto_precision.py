"""What ``rollout_precision="auto"`` samples with: the policy's own weights, or bf16 copies of a float32 policy where
those are measured faster and the mismatch correction applies (:mod:`grpokit.rollout.precision` makes the copies)."""

from __future__ import annotations

import torch

AUTO_COPY_MIN_BYTES = 64 * 2**20
"""``"auto"`` copies only a policy whose linear layers hold at least this many bytes: below it a decode step's
weights stay in the CPU's caches and reading half the bytes saves little."""


def auto_rollout_precision(args, model: torch.nn.Module) -> tuple[str, str]:
    """The precision grpokit's own sampler takes for ``args.rollout_precision`` on ``model``, and why (a sentence;
    empty when nothing was chosen): the field itself unless it is ``"auto"``. ``"auto"`` is ``"bf16"`` — copies of a
    float32 policy's linear layers in bf16, the mismatch corrected in the loss — where that is measured faster and the
    correction applies: a policy on the CPU whose linear layers are float32 and hold :data:`AUTO_COPY_MIN_BYTES`,
    bf16 products at least :data:`grpokit.machine.cpu_features.BF16_MIN_SPEEDUP` times faster (the demo's rule for
    bf16 weights; where they are, a decode step on the copies was 1.07–1.50× the float32 one and the step 1.13–1.22×:
    benchmarks/RESULTS.md, "bf16 copies on an AMD EPYC"), ``vllm_importance_sampling_correction`` on with a mode
    the loss takes, rollouts in the learner's thread (``max_staleness=0``, no rollout workers) and no routing
    replay; else the policy's own weights (``"auto"``)."""
    precision = getattr(args, "rollout_precision", "auto")
    if precision != "auto":
        return precision, ""
    from ..algorithms.losses import loss_spec

    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # quantised ones too: refused
    size = sum(w.numel() * w.element_size() for w in linears)
    folds_sequence = (loss_spec(args.loss_type).sampler_ratio == "fold"
                      and args.vllm_importance_sampling_mode.startswith("sequence"))
    on_cpu = getattr(getattr(args, "device", None), "type", "cpu") == "cpu"  # where the trainer will put the policy
    if (not on_cpu or not linears or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in linears)
            or size < AUTO_COPY_MIN_BYTES or not args.vllm_importance_sampling_correction or folds_sequence
            or args.max_staleness > 0 or getattr(args, "rollout_workers", 0) or args.routing_replay != "none"
            or getattr(getattr(model, "config", None), "vision_config", None) is not None):
        return "auto", ""
    from ..machine.cpu_features import BF16_MIN_SPEEDUP, measured_bf16_speedup, native_bf16

    speedup = measured_bf16_speedup() if native_bf16() else 0.0
    if speedup < BF16_MIN_SPEEDUP:
        return "auto", ""
    return "bf16", (f"rollout_precision='auto': sampling with bf16 copies of the float32 linear layers ({size / 2**20:.0f} "
                    f"MB), bf16 products measured {speedup:.1f}x float32 on this CPU; the mismatch is corrected "
                    "(sampling/* metrics); rollout_precision='float32' samples with the policy's own weights")
