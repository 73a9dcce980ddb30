"""Generation backends behind one small interface (:class:`RolloutBackend`): transformers ``generate`` (default)
and vLLM; :func:`sample_and_score` is the path from dataset rows to scored completions."""

from .base import Generation, RolloutBackend, SamplingParams, completion_mask_from_eos
from .sample import ScoredSamples, sample_and_score
from .transformers_backend import TransformersRollout

__all__ = ["Generation", "RolloutBackend", "SamplingParams", "ScoredSamples", "TransformersRollout",
           "completion_mask_from_eos", "sample_and_score"]
