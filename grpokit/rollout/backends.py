"""The generation backend a config asks for."""

from __future__ import annotations

from ..vision.encoding import tokenizer_of
from .transformers_backend import TransformersRollout


def default_rollout(model, processing_class, args):
    """The generation backend the config asks for: vLLM, transformers' continuous batching, or ``generate``."""
    if args.use_vllm:
        from .vllm_backend import VLLMRollout

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
    if args.use_transformers_continuous_batching:
        from .continuous_batching import ContinuousBatchingRollout

        return ContinuousBatchingRollout(processing_class, args.transformers_continuous_batching_config)
    return TransformersRollout(tokenizer_of(processing_class))

