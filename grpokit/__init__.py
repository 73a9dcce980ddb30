"""grpokit: GRPO-family RL fine-tuning of language models with a TRL-compatible interface."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes logs a warning on every import on CPUs with AVX512-BF16 about an optional 4-bit kernel package;
# grpokit never uses 4-bit CPU kernels, so drop that one message (and nothing else).
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")
)
# DeepSpeed (imported by accelerate when installed) warns on every CPU-only machine that it found no GPU; grpokit
# only uses DeepSpeed when the user configures it, so drop that one message too.
_logging.getLogger("DeepSpeed").addFilter(
    lambda record: not str(record.msg).startswith("Setting accelerator to CPU")
)


def __getattr__(name):  # heavy imports (torch, transformers) only when asked for: `grpokit --help` stays fast
    if name in ("compute_advantages", "policy_loss"):
        from . import algorithms

        return getattr(algorithms, name)
    if name == "GRPOConfig":
        from .config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    if name in ("load_model", "load_tokenizer"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")


__all__ = ["GRPOConfig", "GRPOTrainer", "compute_advantages", "load_model", "load_tokenizer", "policy_loss",
           "__version__"]
