"""The non-finite gradient guard: before an optimizer step, a NaN or infinite gradient never reaches the weights."""

from __future__ import annotations

import torch


def guard_gradients(trainer, state, norm) -> None:
    """Before an optimizer step: a non-finite gradient never reaches the weights. Raise (the step is not taken)
    or, with ``skip_nonfinite_steps``, drop the gradients so the optimizer leaves every parameter and its state
    as is. ``norm``: the gradient norm the Trainer took just before (None: not taken)."""
    if trainer.is_deepspeed_enabled or getattr(trainer.accelerator, "scaler", None) is not None:
        return  # DeepSpeed and the fp16 grad scaler skip overflowing steps themselves
    if norm is not None and bool(torch.isfinite(torch.as_tensor(norm))):
        return  # the Trainer's gradient norm, taken just before, is finite: so is every gradient (no 2nd pass)
    params = [(n, p) for n, p in trainer.model.named_parameters() if p.grad is not None]
    if not params or torch.stack([torch.isfinite(p.grad).all() for _, p in params]).all():
        return
    bad = [n for n, p in params if not torch.isfinite(p.grad).all()]
    trainer.model.zero_grad(set_to_none=True)
    if trainer.args.skip_nonfinite_steps:
        trainer.record_metric("skipped_nonfinite", 1.0)
        return
    raise FloatingPointError(
        f"non-finite gradients in {len(bad)} of {len(params)} parameters (first: {bad[0]}) at step "
        f"{state.global_step + 1}; the weights were not updated. Lower the learning rate or max_grad_norm, check "
        "the rewards, or set skip_nonfinite_steps=True to skip such steps"
    )
