"""What ``GRPOTrainer.__init__`` sets up before ``transformers.Trainer`` takes over: the policy and its tokenizer,
the adapter, the reward functions and their tokenizers, the rollout backend, tools and environments, and the checks of
the datasets and settings that must fail before a model is loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from .config import GRPOConfig
from .data import check_dataset, check_prompt_count, is_iterable_dataset
from .rewards import check_reward_weights, resolve_reward_funcs, reward_func_name
from .rollout.transformers_backend import TransformersRollout
from .validation import short_repr
from .vision.encoding import tokenizer_of

logger = logging.getLogger("grpokit")


@dataclass
class Rewards:
    """The reward functions the trainer scores with (the user's, then environments' ``get_reward``), their tokenizers
    (reward models), the names they are logged under and their weights (one more, 1.0, for DAPO's overlong penalty
    column)."""

    funcs: list
    processing_classes: list
    names: list[str]
    weights: torch.Tensor
    process: Any = None
    """The reward process the user's functions score in (``reward_process=True``: grpokit/rewards/process.py)."""


def setup_rewards(reward_funcs, reward_processing_classes, args: GRPOConfig, multiturn) -> Rewards:
    extra = multiturn.reward_funcs() if multiturn is not None else []  # environments' get_reward
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        if not extra:
            raise ValueError("No reward source provided: pass reward_funcs, or an environment_factory whose "
                             "environments have a get_reward() method")
        user = []
    else:
        user = resolve_reward_funcs(reward_funcs)
    check_reward_weights(args.reward_weights, [reward_func_name(f) for f in user])
    funcs = user + extra
    if reward_processing_classes is None:
        reward_processing_classes = [None] * len(user)
    elif not isinstance(reward_processing_classes, (list, tuple)):
        reward_processing_classes = [reward_processing_classes]
    if len(reward_processing_classes) != len(user):
        raise ValueError(
            f"reward_processing_classes has {len(reward_processing_classes)} entries for "
            f"{len(user)} reward functions: the lengths must match (None for a reward function that is not a model)"
        )
    processing_classes = [_reward_tokenizer(func, proc) for func, proc in
                          zip(funcs, list(reward_processing_classes) + [None] * len(extra))]
    weights = list(args.reward_weights or [1.0] * len(user)) + [1.0] * len(extra)
    if args.overlong_buffer_length is not None:
        weights.append(1.0)  # the overlong penalty enters as one more reward column
    names = [reward_func_name(f) for f in funcs]
    funcs, process = _in_reward_process(funcs, len(user), args, multiturn)
    return Rewards(funcs, processing_classes, names, torch.tensor(weights, dtype=torch.float32), process)


def _in_reward_process(funcs: list, n_user: int, args: GRPOConfig, multiturn) -> tuple[list, Any]:
    """With ``reward_process``: the user's reward functions (not reward models, which stay on the trainer's device)
    replaced by their stand-ins in one reward process (grpokit/rewards/process.py), after checking each can cross."""
    from .rewards.process import ProcessReward, RewardProcess, check_picklable, default_memory_mb

    moved = [i for i, f in enumerate(funcs[:n_user]) if not isinstance(f, torch.nn.Module)]
    if not args.reward_process or not moved:
        return funcs, None
    if multiturn is not None and multiturn.environments is not None:
        raise ValueError("reward_process=True is not allowed with environment_factory: reward functions receive the "
                         "environment instances (environments=), which live in the trainer's process; use "
                         "reward_process=False")
    check_picklable([funcs[i] for i in moved])
    memory = args.worker_memory_mb if args.worker_memory_mb is not None else default_memory_mb()
    process = RewardProcess([funcs[i] for i in moved], memory)
    out = list(funcs)
    for k, i in enumerate(moved):
        out[i] = ProcessReward(funcs[i], k, process)
    return out, process


def _reward_tokenizer(func, proc):
    """A reward model's tokenizer (loaded with it when not given), padded; the model learns its pad token."""
    if isinstance(func, torch.nn.Module) and proc is None:
        proc = transformers.AutoTokenizer.from_pretrained(func.config._name_or_path)
    if proc is not None and proc.pad_token_id is None:
        proc.pad_token = proc.eos_token
    if isinstance(func, torch.nn.Module) and proc is not None:
        # the reward is read at the last non-padding token: the model must know which token pads
        config = func.config.get_text_config() if hasattr(func.config, "get_text_config") else func.config
        config.pad_token_id = proc.pad_token_id
    return proc


def load_policy(model, model_id, processing_class, args: GRPOConfig, quantization_config=None):
    """The policy model (loaded when given by name, quantised with ``quantization_config``) and its tokenizer — a
    vision-language model's processor (TRL's ``processing_class``), loaded with it when not given —, padded on the
    left; the model's configs learn the pad token; dropout off with ``disable_dropout``."""
    if isinstance(model, str):
        from .models import load_model

        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError("quantization_config is given both to GRPOTrainer and in GRPOConfig.model_init_kwargs; "
                                 "give it once (to the trainer)")
            init_kwargs["quantization_config"] = quantization_config
        model = load_model(model, trust_remote_code=args.trust_remote_code, **init_kwargs)
    else:
        for what, value in (("model_init_kwargs", args.model_init_kwargs), ("quantization_config", quantization_config)):
            if value:
                logger.warning("%s is ignored: the model was passed already loaded", what)
    if processing_class is None:
        processing_class = _load_processing_class(model, model_id, args)
    tokenizer = tokenizer_of(processing_class)  # a processor's tokenizer pads
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model, processing_class


def _load_processing_class(model, model_id, args: GRPOConfig):
    """The processing class of the model's checkpoint: a vision-language model's processor, else its tokenizer."""
    from .vision.detection import is_vlm

    name = model_id if isinstance(model_id, str) else model.name_or_path
    if is_vlm(model):
        from .vision.loading import load_processor

        return load_processor(name, trust_remote_code=args.trust_remote_code)
    from .models import load_tokenizer

    return load_tokenizer(name, trust_remote_code=args.trust_remote_code)


def is_peft(model) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


def default_rollout(model, processing_class, args: GRPOConfig):
    """The generation backend the config asks for: vLLM, transformers' continuous batching, or ``generate``."""
    if args.use_vllm:
        from .rollout.vllm_backend import VLLMRollout

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
    if args.use_transformers_continuous_batching:
        from .rollout.continuous_batching import ContinuousBatchingRollout

        return ContinuousBatchingRollout(processing_class, args.transformers_continuous_batching_config)
    return TransformersRollout(tokenizer_of(processing_class))


def check_vocabulary(model, tokenizer) -> None:
    """A tokenizer with more tokens than the model has embeddings would crash the forward on the first such id."""
    tokenizer = tokenizer_of(tokenizer)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if rows is not None and size is not None and size > rows:
        raise ValueError(f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: ids from {rows} on "
                         "would fail in the forward; use the model's own tokenizer, or call "
                         "model.resize_token_embeddings(len(tokenizer)) first")


def add_adapter(model, peft_config, args: GRPOConfig):
    """Wrap the policy with a PEFT adapter. A QLoRA base (4-/8-bit) keeps its adapter in bf16 (the QLoRA paper's
    recommendation, as TRL does)."""
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got {type(peft_config).__name__}")
    if is_peft(model):
        raise ValueError("a PeftModel was passed together with peft_config: merge and unload the existing adapter "
                         "first, or pass the PeftModel without peft_config")
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    try:
        model = get_peft_model(model, peft_config)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "no modules were targeted" not in str(e).lower():
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"peft_config.target_modules={short_repr(getattr(peft_config, 'target_modules', None))} "
                         f"matches no module of the model; its linear modules are named {', '.join(linear)} "
                         "(or use 'all-linear')") from None
    if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    if quantized:
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
    return model


def keep_4bit_layers_trainable(model) -> None:
    """bitsandbytes (0.50) repacks a 4-bit weight for its CPU kernel on the first forward in eval mode without
    gradient (generation) and never unpacks it for training, whose matmuls then have no backward: an adapter on a
    4-bit base would get no gradient after the first rollout. Keep the trainable layout (CPU only)."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def check_datasets(args: GRPOConfig, train_dataset, eval_dataset) -> None:
    """Before a model is loaded: the datasets have prompts, and enough of them for one generation batch. A stream
    (``IterableDataset``) needs ``max_steps`` (its length is unknown) and every process reading it
    (``dispatch_batches=False``, no dataloader workers, which would interleave and split groups), as in TRL."""
    check_dataset("train_dataset", train_dataset)
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(is_iterable_dataset(d) for d in [train_dataset, *evals]):
        args.accelerator_config.dispatch_batches = no_dispatch(args)
    if args.max_staleness > 0:
        if is_iterable_dataset(train_dataset):
            raise ValueError("max_staleness > 0 is not supported with an IterableDataset train_dataset yet: the rollout "
                             "producer reads generation batches ahead by index; use a map-style Dataset")
        if args.world_size > 1 and args.use_vllm and args.vllm_mode == "server":
            raise ValueError("max_staleness > 0 with vllm_mode='server' on several processes is not supported: the "
                             "server's one client gathers every rank's prompts, a collective a producer thread cannot "
                             "make; use vllm_mode='colocate'")
    if is_iterable_dataset(train_dataset):
        if args.dynamic_sampling:
            raise ValueError("dynamic_sampling=True is not supported with an IterableDataset train_dataset yet: it draws "
                             "replacement prompts from the training set by index; use a map-style Dataset")
        if args.max_steps <= 0:
            raise ValueError(f"max_steps={args.max_steps!r} is not allowed with an IterableDataset train_dataset: its "
                             "length is unknown, so set max_steps to a positive number of optimizer steps")
        if args.dataloader_num_workers:
            logger.warning("dataloader_num_workers=%d set to 0: workers would interleave the stream and split the "
                           "groups of num_generations completions", args.dataloader_num_workers)
            args.dataloader_num_workers = 0
    if eval_dataset is not None and not isinstance(eval_dataset, dict):
        check_dataset("eval_dataset", eval_dataset)
    from .vision.images import check_images

    for name, dataset in dataset_items(train_dataset, eval_dataset):
        check_images(dataset, name=name)  # every image read once: a missing file is one line naming row and file
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        check_prompt_count(len(train_dataset), args.generation_batch_size // args.num_generations,
                           f"generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}")


def no_dispatch(args: GRPOConfig) -> bool:
    """``dispatch_batches`` for a stream (``IterableDataset``): False, every process reads it; True is refused."""
    if args.accelerator_config.dispatch_batches is True:
        raise ValueError("accelerator_config.dispatch_batches=True is not allowed: Iterable datasets require "
                         "`dispatch_batches=False` (every process reads the stream); use False or leave it unset")
    return False


def route_recording_absent(rollout, rollout_func, multiturn, model=None) -> str:
    """Why the run's sampler cannot record a Mixture-of-Experts policy's experts ("" when it can: grpokit's
    transformers backend generating every completion in one call)."""
    from .rollout.transformers_backend import TransformersRollout

    if rollout_func is not None:
        return "a rollout_func"
    if multiturn is not None:
        return "tools or an environment_factory"
    from .vision.detection import is_vlm

    if model is not None and is_vlm(model):  # (a VLM's generation with images is not laid out as its rows yet)
        return "a vision-language model"
    if type(rollout).__name__ == "VLLMRollout":  # vLLM can (enable_return_routed_experts); grpokit's client does not ask
        return "use_vllm=True (grpokit does not ask vLLM for the experts it routes to yet)"
    return "" if isinstance(rollout, TransformersRollout) else f"the {type(rollout).__name__} rollout backend"


def multiturn_parts(tools, environment_factory, args: GRPOConfig):
    """The trainer's tools and environments (None without either); checked before any model is loaded."""
    from .tools import MultiTurn, check_tools

    tools = check_tools(tools)
    if not tools and environment_factory is None:
        if args.max_tool_calling_iterations is not None:
            logger.warning("max_tool_calling_iterations=%s has no effect without tools or an environment_factory",
                           args.max_tool_calling_iterations)
        return None
    return MultiTurn(tools, environment_factory, args.max_tool_calling_iterations, args.chat_template_kwargs)


def default_dataset(train_dataset, environment_factory, args: GRPOConfig):
    """Without a train_dataset, an environment that makes its own prompts trains on empty user turns (one
    generation batch of them, repeated), as in TRL; anything else needs a dataset."""
    if train_dataset is not None:
        return train_dataset
    if environment_factory is None:
        raise ValueError("`train_dataset` is required: pass a train_dataset, or an environment_factory whose "
                         "environments make their own prompts (with max_steps)")
    if isinstance(environment_factory, dict):
        raise ValueError("a dict environment_factory (several environments) needs a train_dataset with an "
                         "'environment' column saying which one each prompt uses")
    if args.max_steps <= 0:
        raise ValueError(f"max_steps={args.max_steps!r} is not allowed without a train_dataset: set max_steps to a "
                         "positive number of optimizer steps (the environment makes the prompts)")
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] *
                                        (args.generation_batch_size // args.num_generations)})


def build_pipeline(model, processing_class, rewards: Rewards, args: GRPOConfig, train_dataset, multiturn,
                   rollout_func, trainer, generate_every: int):
    """The trainer's :class:`grpokit.pipeline.RolloutPipeline`: its prompt order over ``train_dataset`` (none for a
    stream), the scorer, dynamic sampling's filter when asked for, and the finishing stage."""
    from .pipeline import BatchFinisher, GroupFilter, PromptOrder, PromptStream, RolloutPipeline, RolloutScorer

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
                             reuses_batches=args.gradient_accumulation_steps % generate_every != 0)
    return RolloutPipeline(scorer, finisher, group_filter, order, reward_process=rewards.process, prompts=prompts)


def dataset_items(train_dataset, eval_dataset) -> list[tuple[str, object]]:
    """``(name, dataset)`` of the training set and every evaluation set (a dict of them named by key)."""
    items = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        items += [(f"eval_dataset[{k!r}]", d) for k, d in eval_dataset.items()]
    else:
        items.append(("eval_dataset", eval_dataset))
    return [(n, d) for n, d in items if d is not None]


def setup_vision(model, processing_class, args: GRPOConfig, train_dataset, eval_dataset, *, rollout_func=None,
                 peft_config=None) -> None:
    """A vision-language model's setup, once the model and its processing class are known: datasets with images need
    a VLM and its processor (one error line otherwise: the model would train on the text alone), and a generation
    path that sends the images; ``ddp_find_unused_parameters`` on for a VLM (TRL's rule: a text-only batch leaves the
    vision tower without gradients); ``freeze_vision`` freezes its vision tower and projector in full fine-tuning."""
    from .data import is_iterable_dataset
    from .vision.detection import check_vision_setup, is_processor, is_vlm
    from .vision.images import image_column

    for name, dataset in dataset_items(train_dataset, eval_dataset):
        columns = getattr(dataset, "column_names", None)
        if columns is None and not is_iterable_dataset(dataset) and hasattr(dataset, "__len__") and len(dataset):
            columns = list(dataset[0]) if isinstance(dataset[0], dict) else None
        has_images = image_column(columns) is not None
        check_vision_setup(model, processing_class, has_images, dataset=name)
        if has_images and rollout_func is not None:
            raise ValueError(f"{name} has images, which rollout_func does not support (it returns token ids without "
                             "the image tensors, so the model would train on the text alone); drop rollout_func or "
                             "the image column")
    if is_processor(processing_class):
        if args.use_transformers_continuous_batching:
            raise ValueError("use_transformers_continuous_batching=True is not supported with a vision-language "
                             "model's processor (as in TRL); use the default generation or use_vllm=True")
        grad_ckpt = args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        if args.ddp_find_unused_parameters is None and not grad_ckpt:
            args.ddp_find_unused_parameters = True
    if args.freeze_vision:
        if not is_vlm(model):
            raise ValueError(f"freeze_vision=True is not allowed: {type(model).__name__} is not a vision-language "
                             "model; leave it False")
        if peft_config is None and not is_peft(model):
            from .vision.adapters import freeze_vision

            freeze_vision(model)
