"""Vision-language models: images from dataset rows, prompts with images encoded through the model's processor, the
image tensors that travel with their prompts to every forward, detection and loading, and what trains (docs/vision.md).

The trainer and the rollout backends call these; everything here is tested on its own (tests/vision/).
"""

from .adapters import freeze_vision, language_lora_targets, lora_settings, parameter_parts
from .detection import (
    TESTED_FAMILIES,
    check_vision_setup,
    image_token_ids,
    is_processor,
    is_vlm,
    is_vlm_config,
    vlm_family,
)
from .encoding import EncodedPrompts, encode_batch, encode_prompts, encode_rows, tokenizer_of
from .images import IMAGE_COLUMNS, batch_images, check_images, image_column, row_images, to_pil
from .inputs import VisionInputs
from .loading import load_processor, load_vlm, processor_without_video
from .messages import place_images, prompt_images, strip_images

__all__ = [
    "IMAGE_COLUMNS",
    "TESTED_FAMILIES",
    "EncodedPrompts",
    "VisionInputs",
    "batch_images",
    "check_images",
    "check_vision_setup",
    "encode_batch",
    "encode_prompts",
    "encode_rows",
    "freeze_vision",
    "image_column",
    "image_token_ids",
    "is_processor",
    "is_vlm",
    "is_vlm_config",
    "language_lora_targets",
    "load_processor",
    "load_vlm",
    "lora_settings",
    "parameter_parts",
    "place_images",
    "processor_without_video",
    "prompt_images",
    "row_images",
    "strip_images",
    "to_pil",
    "tokenizer_of",
    "vlm_family",
]
