"""Generation engines behind one small interface (:class:`RolloutBackend`): transformers ``generate`` (default, with
grpokit's CPU decode loop), continuous batching and vLLM. The path from dataset rows to scored completions is the
rollout pipeline's (``grpokit.pipeline``)."""

from .base import Generation, RolloutBackend, SamplingParams, completion_mask_from_eos
from .transformers_backend import TransformersRollout

__all__ = ["Generation", "RolloutBackend", "SamplingParams", "TransformersRollout", "completion_mask_from_eos"]
