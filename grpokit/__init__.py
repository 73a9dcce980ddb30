"""grpokit: GRPO-family RL fine-tuning of language models with a TRL-compatible interface."""

__version__ = "0.1.0"

from .algorithms import compute_advantages, policy_loss  # noqa: E402

__all__ = ["compute_advantages", "policy_loss", "__version__"]
