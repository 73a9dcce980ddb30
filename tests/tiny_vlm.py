"""Tiny random-weight vision-language models with processors built in-process (no download, no torchvision), one
per family TRL's vision tests cover that transformers can build offline.

``tiny_vlm(family)`` returns ``(model, processor)``; ``save_tiny_vlm(family, directory)`` writes both where a user's
local model would be. Every model has a hidden size of 32 and 2 layers (language and vision); images are resized to
at most 32-64 pixels a side, so an image is 1-16 tokens and a forward takes milliseconds. The tokenizer is the
byte-level one of ``tiny.py`` plus each family's image tokens, and every family gets a ChatML-like chat template
that places the family's image marker where a message has an ``{"type": "image"}`` part. ``<|im_end|>`` ends a
turn.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpokit.vision.loading import needs_video_fallback, processor_without_video

BASE_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
HIDDEN = 32


def chat_template(image_marker: str) -> str:
    """ChatML with each image part rendered as ``image_marker`` (the text the family's processor expands)."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image_marker +
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def vlm_tokenizer(specials: list[str], named: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of ``tiny.py`` with ``specials`` as extra special tokens (ids after ``<pad>``,
    ``<|im_start|>``, ``<|im_end|>``) and ``named`` tokens as attributes (``tokenizer.image_token``, ...)."""
    vocab = {t: i for i, t in enumerate(BASE_SPECIALS + specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(pattern="", behavior="isolated"),
    ])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", additional_special_tokens=list(specials),
                                   extra_special_tokens=dict(named or {}))
    fast.padding_side = "left"
    return fast


def _text_config(tok, **extra) -> dict:
    return dict(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=1024,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                **extra)


def _build(processor_cls, *args, **kwargs):
    """The processor, without its video processor where torchvision is missing (grpokit.vision.loading)."""
    if needs_video_fallback(processor_cls):
        processor_cls = processor_without_video(processor_cls)
        kwargs["video_processor"] = None
    return processor_cls(*args, **kwargs)


def _finish(model, tok):
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model


# -- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: flattened patches + image_grid_thw, M-RoPE ----------------------------------
QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|endoftext|>"]
QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen_ids(tok) -> dict:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _qwen_processor(processor_cls, patch: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = vlm_tokenizer(QWEN_SPECIALS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    factor = patch * 2  # patch × spatial merge
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                      min_pixels=factor * factor, max_pixels=4 * factor * factor)
    return tok, _build(processor_cls, images, tok, chat_template=chat_template(QWEN_MARKER))


def qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    tok, processor = _qwen_processor(Qwen2VLProcessor, 14)
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1]}
    cfg = Qwen2VLConfig(text_config=_text_config(tok, rope_scaling=rope), **_qwen_ids(tok),
                        vision_config=dict(depth=2, embed_dim=HIDDEN, hidden_size=HIDDEN, num_heads=4, mlp_ratio=2,
                                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    return _finish(Qwen2VLForConditionalGeneration(cfg), tok), processor


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    tok, processor = _qwen_processor(Qwen2_5_VLProcessor, 14)
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1]}
    cfg = Qwen2_5_VLConfig(text_config=_text_config(tok, rope_scaling=rope), **_qwen_ids(tok),
                           vision_config=dict(depth=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=4,
                                              out_hidden_size=HIDDEN, fullatt_block_indexes=[1], window_size=56,
                                              patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    return _finish(Qwen2_5_VLForConditionalGeneration(cfg), tok), processor


def qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    tok, processor = _qwen_processor(Qwen3VLProcessor, 16)
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    cfg = Qwen3VLConfig(text_config=_text_config(tok, rope_parameters=rope), **_qwen_ids(tok),
                        vision_config=dict(depth=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=4,
                                           out_hidden_size=HIDDEN, num_position_embeddings=16,
                                           deepstack_visual_indexes=[1], patch_size=16, spatial_merge_size=2,
                                           temporal_patch_size=2))
    return _finish(Qwen3VLForConditionalGeneration(cfg), tok), processor


def _qwen3_5(config_cls, model_cls, **text_extra):
    from transformers import Qwen3VLProcessor

    tok, processor = _qwen_processor(Qwen3VLProcessor, 16)
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "partial_rotary_factor": 1.0}
    text = _text_config(tok, rope_parameters=rope, layer_types=["linear_attention", "full_attention"],
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_conv_kernel_dim=4, **text_extra)
    cfg = config_cls(text_config=text, **_qwen_ids(tok),
                     vision_config=dict(depth=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=4,
                                        out_hidden_size=HIDDEN, num_position_embeddings=16, patch_size=16,
                                        spatial_merge_size=2, temporal_patch_size=2))
    return _finish(model_cls(cfg), tok), processor


def qwen3_5():
    """Qwen3.5: Qwen3-VL's vision with a hybrid language model (a linear-attention layer and a full one)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _qwen3_5(Qwen3_5Config, Qwen3_5ForConditionalGeneration)


def qwen3_5_moe():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return _qwen3_5(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN)


# -- Idefics3 / SmolVLM: per-row padded image stacks + pixel_attention_mask ---------------------------------------
IDEFICS_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def _idefics(config_cls, model_cls, processor_cls, image_processor_cls):
    tok = vlm_tokenizer(IDEFICS_SPECIALS, {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                                           "global_image_token": "<global-img>",
                                           "end_of_utterance_token": "<end_of_utterance>"})
    images = image_processor_cls(do_image_splitting=False, size={"longest_edge": 32},
                                 max_image_size={"longest_edge": 32})
    processor = _build(processor_cls, images, tok, image_seq_len=4, chat_template=chat_template("<image>"))
    cfg = config_cls(text_config=dict(_text_config(tok), model_type="llama"), scale_factor=2,
                     image_token_id=tok.convert_tokens_to_ids("<image>"),
                     vision_config=dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=32, patch_size=8))
    return _finish(model_cls(cfg), tok), processor


def idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return _idefics(Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, Idefics3ImageProcessorPil)


def smolvlm():
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    return _idefics(SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor, SmolVLMImageProcessorPil)


# -- Gemma 3: one pixel tensor per image, token_type_ids, bidirectional attention over the image ------------------
def gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = vlm_tokenizer(list(named.values()), named)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = _build(Gemma3Processor, images, tok, image_seq_length=4,
                       chat_template=chat_template("<start_of_image>"))
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(text_config=_text_config(tok, layer_types=None, sliding_window=64, query_pre_attn_scalar=8),
                       vision_config=dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=32, patch_size=8, vision_use_head=False),
                       mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"),
                       eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"))
    return _finish(Gemma3ForConditionalGeneration(cfg), tok), processor


# -- LLaVA, LLaVA-NeXT: CLIP tower, image tokens expanded by the processor ----------------------------------------
def _clip_vision() -> dict:
    return dict(model_type="clip_vision_model", hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, image_size=32, patch_size=8, projection_dim=HIDDEN)


def llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = vlm_tokenizer(["<image>"], {"image_token": "<image>"})
    images = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = _build(LlavaProcessor, images, tok, patch_size=8, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=chat_template("<image>"))
    cfg = LlavaConfig(text_config=dict(_text_config(tok), model_type="llama"), vision_config=_clip_vision(),
                      image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=16)
    return _finish(LlavaForConditionalGeneration(cfg), tok), processor


def llava_next():
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = vlm_tokenizer(["<image>"], {"image_token": "<image>"})
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=pinpoints)
    processor = _build(LlavaNextProcessor, images, tok, patch_size=8, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=chat_template("<image>"))
    cfg = LlavaNextConfig(text_config=dict(_text_config(tok), model_type="llama"), vision_config=_clip_vision(),
                          image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints)
    return _finish(LlavaNextForConditionalGeneration(cfg), tok), processor


FAMILIES: dict[str, Callable] = {
    "qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe,
    "idefics3": idefics3, "smolvlm": smolvlm, "gemma3": gemma3, "llava": llava, "llava_next": llava_next,
}


def tiny_vlm(family: str, seed: int = 0):
    """``(model, processor)`` of a tiny random ``family`` VLM (a key of :data:`FAMILIES`), float32, eval mode off."""
    torch.manual_seed(seed)
    return FAMILIES[family]()


def save_tiny_vlm(family: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny ``family`` VLM and its processor to ``directory`` (safetensors, processor and chat template
    files), as a user's local model directory would hold them."""
    model, processor = tiny_vlm(family, seed)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


_SHARED: dict[str, tuple] = {}


def shared_tiny_vlm(family: str):
    """One ``(model, processor)`` per family for the whole test session (in eval mode): for tests that only read
    it. A test that trains or changes a model builds its own with :func:`tiny_vlm`."""
    if family not in _SHARED:
        model, processor = tiny_vlm(family)
        _SHARED[family] = (model.eval(), processor)
    return _SHARED[family]
