"""The rollout pipeline: the stretch from a generation batch's prompts to the batch the loss takes, with typed
hand-offs from stage to stage (docs/architecture.md):

- :mod:`.prompts`: the one seeded prompt order (the dataloader's sampler, the refill stream, the producer);
- :mod:`.samples`: :class:`ScoredSamples` (one scored completion per row), preparing prompts, scoring a generation;
- :mod:`.scoring`: sampling and scoring (rows → :class:`ScoredSamples`); :mod:`.rollout_func`: a user's
  ``rollout_func`` output as the pipeline's types;
- :mod:`.filtering`: dynamic sampling's filter (:class:`GroupFilter`: which groups a round keeps, how large rounds
  are) and the groups a batch gathers (:class:`GroupFill`); :mod:`.prompt_stream`: the prompts beyond the batch,
  with GRESO's skipping (:class:`PromptStream`);
- :mod:`.finishing`: advantages over every process, masks, log-probs (→ :class:`grpokit.batch.RolloutBatch`);
- :mod:`.stats`: :class:`RolloutStats`, the one metrics channel;
- :mod:`.driver`: the seams, declared: what sampling needs (:class:`SamplingDriver`), what finishing needs
  (:class:`FinishingDriver`), both (:class:`RolloutDriver`), what the asynchronous producer needs from the learner
  (:class:`LearnerDriver`), a weight source and a producer;
- :mod:`.producer`: asynchronous rollouts, the same pipeline driven ahead of the learner (a thread);
- :mod:`.partial`: partial rollouts, groups in flight across batches continuing under newer weights
  (``partial_rollouts``; :class:`ContinuingDriver`);
- :mod:`.workers`: rollout workers, the sampling half in processes of their own (``rollout_workers``);
- :mod:`.rollout_pipeline`: :class:`RolloutPipeline`, the stages put together.
"""

from .driver import ContinuingDriver, FinishingDriver, LearnerDriver, Producer, RolloutDriver, SamplingDriver, WeightSource
from .filtering import FillStats, GroupFill, GroupFilter, first_round_groups, next_round_groups
from .finishing import BatchFinisher
from .prompt_skipping import PromptSkipper, prompt_key
from .prompt_stream import PromptStream
from .prompts import GroupRepeatIterable, GroupRepeatSampler, PromptOrder
from .rollout_pipeline import RolloutPipeline
from .samples import ScoredSamples, sample_and_score
from .scoring import RolloutScorer
from .stats import RolloutStats

__all__ = ["BatchFinisher", "ContinuingDriver", "FillStats", "FinishingDriver", "GroupFill", "GroupFilter", "GroupRepeatIterable",
           "GroupRepeatSampler", "LearnerDriver", "Producer", "PromptOrder", "PromptSkipper", "PromptStream",
           "RolloutDriver", "RolloutPipeline", "RolloutScorer", "RolloutStats", "SamplingDriver", "ScoredSamples",
           "WeightSource", "first_round_groups", "next_round_groups", "prompt_key", "sample_and_score"]
