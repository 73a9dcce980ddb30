"""Loading a vision-language model and its processor from a directory or a hub id.

The model class is the one its config names (``config.architectures[0]``, as TRL 1.16 does), else
``AutoModelForImageTextToText``. The processor is ``AutoProcessor``'s, padding and truncating on the left. Where
torchvision is not installed, a processor that also handles video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM, ...)
cannot be built by transformers at all (its video processor needs torchvision); it is then built without its video
processor: images work, videos do not.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

VIDEO_ATTRIBUTES = ("video_processor",)
"""Sub-processors that need torchvision and that an image-only processor goes without."""


class NoVideoProcessor:
    """Stands in for the video processor of an image-only processor: the defaults some processors read from it
    (``num_frames``, ``fps``) are None; anything else is an ``AttributeError`` saying that videos need torchvision."""

    num_frames = None
    fps = None

    def __getattr__(self, name: str):
        raise AttributeError(f"this processor was built without its video processor (torchvision is not installed): "
                         f"videos are not supported here (video_processor.{name})")

    def __call__(self, *args, **kwargs):
        raise ValueError("this processor was built without its video processor (torchvision is not installed): "
                         "videos are not supported here")


@functools.cache
def processor_without_video(cls: type) -> type:
    """A subclass of the processor class ``cls`` with no video processor: its sub-processors are ``cls``'s but
    :data:`VIDEO_ATTRIBUTES` (a :class:`NoVideoProcessor` stands in), and loading it passes
    ``video_processor=None`` to ``cls``'s constructor (construct it with ``video_processor=None`` where ``cls``
    requires one). It keeps ``cls``'s name, so a processor saved from it is ``cls``'s on disk."""
    attributes = [a for a in cls.get_attributes() if a not in VIDEO_ATTRIBUTES]

    def get_attributes(_cls):
        return list(attributes)

    def from_args_and_dict(sub, args, processor_dict, **kwargs):
        return super(sub, sub).from_args_and_dict.__func__(sub, args, processor_dict,
                                                           **{**kwargs, "video_processor": None})

    def from_dict(sub, processor_dict, **kwargs):  # what from_pretrained builds with since transformers 5.25
        return super(sub, sub).from_dict.__func__(sub, processor_dict, **{**kwargs, "video_processor": None})

    # transformers reads the sub-processors from ``get_attributes`` and saves only what is in the instance's
    # ``__dict__``: the stand-in, a class attribute, is never saved
    methods = {"get_attributes": classmethod(get_attributes), "from_args_and_dict": classmethod(from_args_and_dict)}
    if hasattr(cls, "from_dict"):
        methods["from_dict"] = classmethod(from_dict)
    return type(cls.__name__, (cls,), {
        **methods, "video_processor": NoVideoProcessor(), "__module__": cls.__module__,
        "__qualname__": cls.__qualname__, "grpokit_image_only": True})


def needs_video_fallback(cls: type) -> bool:
    """Whether transformers cannot build the processor class ``cls`` here: it has a video processor and
    torchvision is missing."""
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available() and any(a in VIDEO_ATTRIBUTES for a in cls.get_attributes())


def _processor_class(name_or_path: str, trust_remote_code: bool, **kwargs) -> type | None:
    """The processor class a checkpoint names (its processor config, else its model type's), or None."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        from transformers.processing_utils import ProcessorMixin

        config_dict, _ = ProcessorMixin.get_processor_dict(name_or_path, **kwargs)
        name = config_dict.get("processor_class")
    except (OSError, ValueError, TypeError):
        name = None
    if name is None:
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError):
            return None
        name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def load_processor(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False, **kwargs) -> Any:
    """The processing class of a checkpoint: its processor (a VLM), or its tokenizer (a text model), padding and
    truncating on the left, with a padding token (the EOS when it has none). See the module docstring for
    checkpoints whose processor needs torchvision."""
    from transformers import AutoProcessor

    name = os.fspath(name_or_path)
    kwargs = {"padding_side": "left", "truncation_side": "left", **kwargs}
    cls = _processor_class(name, trust_remote_code)
    if cls is not None and needs_video_fallback(cls):
        processor = processor_without_video(cls).from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    else:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def model_class_for(config) -> type:
    """The class that loads a VLM checkpoint: the architecture its config names when transformers has it, else
    ``AutoModelForImageTextToText``."""
    import transformers
    from transformers import AutoModelForImageTextToText

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return AutoModelForImageTextToText


def load_vlm(name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
             trust_remote_code: bool = False, **kwargs):
    """A vision-language model, trainable and unquantised unless asked (``kwargs`` go to ``from_pretrained``;
    ``use_safetensors`` defaults to True). ``grpokit.models.load_model`` calls this for a VLM checkpoint and makes
    its generation config name an EOS and a padding token."""
    from transformers import AutoConfig

    name = os.fspath(name_or_path)
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    kwargs.setdefault("use_safetensors", True)
    return model_class_for(config).from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
