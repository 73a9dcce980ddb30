"""The trainer's rollout pipeline put together from a run's parts."""

from __future__ import annotations

from ..data import is_iterable_dataset
from ..vision.encoding import tokenizer_of


def build_pipeline(model, processing_class, rewards, args, train_dataset, multiturn,
                   rollout_func, trainer, generate_every: int, support=None):
    """The trainer's :class:`grpokit.pipeline.RolloutPipeline`: its prompt order over ``train_dataset`` (none for a
    stream), the scorer, dynamic sampling's filter when asked for, and the finishing stage (``support``: the
    sampler's :class:`grpokit.algorithms.sampling_support.SamplingSupport`, the run's settings when None)."""
    from .filtering import GroupFilter
    from .finishing import BatchFinisher
    from .prompt_stream import PromptStream
    from .prompts import PromptOrder
    from .rollout_pipeline import RolloutPipeline
    from .scoring import RolloutScorer

    prompts_per_batch = args.generation_batch_size // args.num_generations
    order = None
    if train_dataset is not None and not is_iterable_dataset(train_dataset):
        order = PromptOrder(len(train_dataset), prompts_per_batch, bool(args.shuffle_dataset), args.seed)
    scorer = RolloutScorer(model, processing_class, rewards.funcs, rewards.processing_classes, args,
                           multiturn=multiturn, rollout_func=rollout_func, rollout_func_owner=trainer)
    group_filter = prompts = None
    if args.dynamic_sampling:
        group_filter = GroupFilter(args, rewards.weights, tokenizer_of(processing_class).pad_token_id)
        prompts = PromptStream(train_dataset, order, args, rewards.weights, rank=args.process_index,
                               world_size=args.world_size)
    finisher = BatchFinisher(args, rewards.names, rewards.weights,
                             reuses_batches=args.gradient_accumulation_steps % generate_every != 0, support=support)
    return RolloutPipeline(scorer, finisher, group_filter, order, reward_process=rewards.process, prompts=prompts,
                           support=finisher.support)

