"""Rollout backends behind one interface (:class:`RolloutBackend`)."""

from .base import RolloutBackend, RolloutBatch, SamplingParams, completion_mask_from_eos
from .transformers_backend import TransformersRollout

__all__ = ["RolloutBackend", "RolloutBatch", "SamplingParams", "TransformersRollout", "completion_mask_from_eos"]
