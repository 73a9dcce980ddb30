"""The generation backend a config asks for."""

from __future__ import annotations

import logging

import torch

from ..vision.encoding import tokenizer_of
from .auto_precision import auto_rollout_precision
from .transformers_backend import TransformersRollout

logger = logging.getLogger("grpokit")


def default_rollout(model, processing_class, args):
    """The generation backend the config asks for: vLLM, transformers' continuous batching, or ``generate``."""
    if args.use_vllm:
        from .vllm_backend import VLLMRollout

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
    if args.use_transformers_continuous_batching:
        from .continuous_batching import ContinuousBatchingRollout

        return ContinuousBatchingRollout(processing_class, args.transformers_continuous_batching_config)
    precision = getattr(args, "rollout_precision", "auto")
    device = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    if precision != "auto" and device is not None and device.type != "cpu":
        from ..validation import refusal

        raise refusal("rollout_precision", precision, "grpokit samples in another precision on a CPU; on an "
                      "accelerator use 'auto', or use_vllm=True (the engine's own dtype and 8-bit weights)",
                      when=f"with the policy on {device.type}")
    if isinstance(model, torch.nn.Module):
        precision, why = auto_rollout_precision(args, model)
        if why:
            logger.warning(why)
    return TransformersRollout(tokenizer_of(processing_class), rollout_precision=precision)

