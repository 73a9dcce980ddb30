"""The policy before training: loaded when named, with its tokenizer or processor padded on the left, its vocabulary
checked against the tokenizer, a PEFT adapter added, and a 4-bit base kept trainable on a CPU."""

from __future__ import annotations

import logging

import torch

from ..validation import short_repr
from ..vision.encoding import tokenizer_of

logger = logging.getLogger("grpokit")


def load_policy(model, model_id, processing_class, args, quantization_config=None):
    """The policy model (loaded when given by name, quantised with ``quantization_config``) and its tokenizer — a
    vision-language model's processor (TRL's ``processing_class``), loaded with it when not given —, padded on the
    left; the model's configs learn the pad token; dropout off with ``disable_dropout``."""
    if isinstance(model, str):
        from ..models import load_model

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


def _load_processing_class(model, model_id, args):
    """The processing class of the model's checkpoint: a vision-language model's processor, else its tokenizer."""
    from ..vision.detection import is_vlm

    name = model_id if isinstance(model_id, str) else model.name_or_path
    if is_vlm(model):
        from ..vision.loading import load_processor

        return load_processor(name, trust_remote_code=args.trust_remote_code)
    from ..models import load_tokenizer

    return load_tokenizer(name, trust_remote_code=args.trust_remote_code)


def is_peft(model) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


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


def add_adapter(model, peft_config, args):
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

