"""The reference policy π_ref of the KL term (``beta > 0``) when it moves: TR-DPO's soft update
(``sync_ref_model``, Gorbatovski et al., arXiv 2404.09656), as TRL 1.16 applies it to GRPO.

Every ``ref_model_sync_steps`` optimizer steps::

    π_ref ← α · π_θ + (1 − α) · π_ref        (α = ref_model_mixup_alpha, parameter by parameter)

α = 1 copies the policy (a hard update). The reference's weights go into every checkpoint
(``grpokit_reference.safetensors``) so a resumed run continues from the same reference.
"""

from __future__ import annotations

import torch

from ..algorithms.averaging import mix_

REFERENCE_FILE = "grpokit_reference.safetensors"


def mix_into_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """``reference ← alpha · policy + (1 − alpha) · reference`` for every parameter, in place (same architecture,
    same parameter order; each tensor in its own dtype): :func:`grpokit.algorithms.averaging.mix_`."""
    try:
        mix_(list(reference.parameters()), list(policy.parameters()), alpha)
    except ValueError as e:
        raise ValueError(f"the reference and the policy do not match: {e}") from None


def check_sync_ref_model(args, peft: bool, sharding: str | None) -> None:
    """``sync_ref_model`` needs a reference model of its own: ``beta`` > 0, no PEFT adapter (its reference is the
    base model with the adapter off), and whole weights on each process."""
    if not args.sync_ref_model:
        return
    if args.beta == 0.0:
        raise ValueError("sync_ref_model=True needs beta > 0: with beta=0.0 there is no reference model to update "
                         "(set beta, or sync_ref_model=False)")
    if peft:
        raise ValueError("sync_ref_model=True is not supported with a PEFT adapter: its reference is the base model with "
                         "the adapter disabled, not a model of its own (use full fine-tuning, or sync_ref_model=False)")
    if sharding is not None:
        raise ValueError(f"sync_ref_model=True is not supported with sharded weights ({sharding}) yet: use DDP or one "
                         "process, or sync_ref_model=False")


class ReferenceWeights:
    """``sync_ref_model``'s reference as a checkpoint part (grpokit/run/checkpoint_parts.py): its parameters (tied ones
    once), which drift from the initial policy as it is synced."""

    checkpoint_file = REFERENCE_FILE

    def __init__(self, reference: torch.nn.Module):
        self.reference = reference

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.reference.named_parameters())

    def load_state_dict(self, state: dict) -> None:
        saved = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        params = dict(self.reference.named_parameters())
        if set(saved) != set(params):
            raise ValueError("it does not hold this reference model's parameters (different model?)")
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
