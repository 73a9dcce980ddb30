"""Whether a model, a config or a processing class is a vision-language one, which family it is, and the check that
images never meet a text-only model (or a VLM without its processor) silently.

A config is a VLM's when it has a ``vision_config`` or transformers maps its type to an image-text-to-text model. The
family is the config's ``model_type`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``idefics3``, ``smolvlm``,
``gemma3``, ``llava``, ``llava_next``, ...); :data:`TESTED_FAMILIES` are those grpokit's tests build and run.
"""

from __future__ import annotations

from typing import Any

TESTED_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "idefics3", "smolvlm", "gemma3", "llava",
                   "llava_next")
"""Families built offline and run by grpokit's tests (tests/tiny_vlm.py)."""

_IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _config_of(obj: Any):
    """The config of a model (DDP / PEFT wrappers included) or a config itself."""
    from ..forward.prefix import inner_causal_lm

    if hasattr(obj, "to_dict") and hasattr(obj, "model_type"):
        return obj
    if hasattr(obj, "get_base_model") or hasattr(obj, "module"):
        obj = inner_causal_lm(obj) or obj
    return getattr(obj, "config", None)


def is_vlm_config(config: Any) -> bool:
    """A vision-language model's config: it has a vision config, or its type is an image-text-to-text model's."""
    if config is None:
        return False
    if getattr(config, "vision_config", None) is not None:
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_vlm(model_or_config: Any) -> bool:
    """Whether a model (wrapped or not) or a config is a vision-language model."""
    return is_vlm_config(_config_of(model_or_config))


def vlm_family(model_or_config: Any) -> str | None:
    """The family (the config's ``model_type``) of a vision-language model; None for a text-only model."""
    config = _config_of(model_or_config)
    return getattr(config, "model_type", None) if is_vlm_config(config) else None


def is_processor(processing_class: Any) -> bool:
    """Whether a processing class can encode images: a transformers processor with an image processor."""
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin) and getattr(processing_class, "image_processor", None) is not None


def image_token_ids(model_or_config: Any) -> list[int]:
    """The ids the model's config reserves for image (and video) placeholders: never to be sampled (a sampled one
    would not match any image features), as TRL suppresses them."""
    config = _config_of(model_or_config)
    ids = {getattr(config, f, None) for f in _IMAGE_TOKEN_FIELDS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def _name(model: Any) -> str:
    config = _config_of(model)
    arch = (getattr(config, "architectures", None) or [None])[0]
    return arch or type(model).__name__


def check_vision_setup(model: Any, processing_class: Any, has_images: bool, *, dataset: str = "train_dataset") -> None:
    """Before training: a dataset with images needs a vision-language model and its processor. Each mismatch is one
    ``ValueError``: images given to a text-only model (which would train on the text alone while reward functions
    see the images), or a VLM given a tokenizer instead of its processor (its vision tower would never run)."""
    if not has_images:
        return
    if not is_vlm(model):
        raise ValueError(f"{dataset} has images (an 'image' or 'images' column) but the model ({_name(model)}) is a "
                         f"text-only model: it cannot see them; use a vision-language model or drop the image column")
    if not is_processor(processing_class):
        raise ValueError(f"{dataset} has images but processing_class is {type(processing_class).__name__}, not the "
                         f"model's processor: the images would never reach the model; pass "
                         f"AutoProcessor.from_pretrained(...) as processing_class, or leave it unset to load it")
