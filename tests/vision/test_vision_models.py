"""Detecting vision-language models, loading them and their processors from a user's model directory (without
torchvision too), and refusing images a model cannot see."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from tiny import tiny_model, tiny_tokenizer
from tiny_vlm import FAMILIES, save_tiny_vlm, shared_tiny_vlm, tiny_vlm

from grpokit.vision import check_vision_setup, image_token_ids, is_processor, is_vlm, load_processor, load_vlm, vlm_family
from grpokit.vision.detection import TESTED_FAMILIES
from grpokit.vision.loading import NoVideoProcessor, needs_video_fallback, processor_without_video

RED = Image.new("RGB", (40, 30), "red")


def test_detection_of_every_family_and_of_text_models():
    assert sorted(TESTED_FAMILIES) == sorted(FAMILIES)
    for family in FAMILIES:
        model, processor = shared_tiny_vlm(family)
        assert is_vlm(model) and is_vlm(model.config) and vlm_family(model) == family
        assert is_processor(processor) and not is_processor(processor.tokenizer)
        assert image_token_ids(model) and all(0 <= i < model.config.get_text_config().vocab_size
                                              for i in image_token_ids(model))
    text = tiny_model()
    assert not is_vlm(text) and vlm_family(text) is None and image_token_ids(text) == []
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(tiny_vlm("llava")[0], peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert vlm_family(wrapped) == "llava" and image_token_ids(wrapped) == [3]


def test_images_never_meet_a_model_that_cannot_see_them():
    model, processor = shared_tiny_vlm("gemma3")
    check_vision_setup(model, processor, has_images=True)
    check_vision_setup(tiny_model(), tiny_tokenizer(), has_images=False)  # text: nothing to check
    check_vision_setup(model, processor.tokenizer, has_images=False)  # a VLM trained on text is allowed
    with pytest.raises(ValueError) as e:
        check_vision_setup(tiny_model(), tiny_tokenizer(), has_images=True, dataset="eval_dataset")
    assert "eval_dataset has images" in str(e.value) and "LlamaForCausalLM) is a text-only model" in str(e.value)
    with pytest.raises(ValueError, match="processing_class is [A-Za-z]+, not the model.s processor: the images would"):
        check_vision_setup(model, processor.tokenizer, has_images=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_model_directory_loads_as_built(family, tmp_path):
    save_tiny_vlm(family, tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "chat_template.jinja"} <= files
    model, processor = load_vlm(tmp_path), load_processor(tmp_path)
    built, built_processor = shared_tiny_vlm(family)
    assert type(model) is type(built) and type(processor).__name__ == type(built_processor).__name__
    assert processor.tokenizer.padding_side == "left" and model.generation_config.pad_token_id == 0
    from transformers import AutoTokenizer

    vocab = model.config.get_text_config().vocab_size  # every id the tokenizers can give has an embedding row
    assert len(processor.tokenizer) <= vocab and len(AutoTokenizer.from_pretrained(tmp_path)) <= vocab
    messages = [{"role": "user", "content": [{"type": "image", "image": RED}, {"type": "text", "text": "Colour?"}]}]
    inputs = []
    for p in (processor, built_processor):
        text = p.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs.append(p(text=[text], images=[[RED]], return_tensors="pt"))
    assert inputs[0].keys() == inputs[1].keys()
    for key in inputs[0]:
        torch.testing.assert_close(inputs[0][key], inputs[1][key], msg=key)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**inputs[0]).logits, built(**inputs[1]).logits, rtol=1e-5, atol=1e-5)


def test_a_text_model_directory_gives_its_tokenizer(tiny_dir):
    tokenizer = load_processor(tiny_dir)
    assert not is_processor(tokenizer) and tokenizer.padding_side == "left"


def test_processors_with_video_are_built_without_it_where_torchvision_is_missing(tmp_path):
    from transformers import Gemma3Processor, Qwen2VLProcessor, SmolVLMProcessor

    image_only = processor_without_video(Qwen2VLProcessor)
    assert image_only.__name__ == "Qwen2VLProcessor" and issubclass(image_only, Qwen2VLProcessor)
    assert image_only.get_attributes() == ["image_processor", "tokenizer"]
    assert processor_without_video(Qwen2VLProcessor) is image_only  # one class per processor class
    assert not needs_video_fallback(Gemma3Processor)  # no video processor: transformers builds it
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert needs_video_fallback(SmolVLMProcessor) and needs_video_fallback(Qwen2VLProcessor)
        save_tiny_vlm("smolvlm", tmp_path)
        processor = load_processor(tmp_path)
        assert isinstance(processor, SmolVLMProcessor) and isinstance(processor.video_processor, NoVideoProcessor)
        saved = json.loads((tmp_path / "processor_config.json").read_text())
        assert saved["processor_class"] == "SmolVLMProcessor" and "video_processor" not in saved
        with pytest.raises(ValueError, match="videos are not supported here"):
            processor.video_processor([])
        with pytest.raises(AttributeError, match="torchvision is not installed"):
            processor.video_processor.size  # noqa: B018


def test_load_model_loads_a_vlm_directory_whole(tmp_path, tiny_dir):
    from grpokit.models import load_model

    save_tiny_vlm("qwen2_vl", tmp_path)  # AutoModelForCausalLM does not know Qwen2-VL
    model = load_model(tmp_path)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and is_vlm(model)
    assert type(load_model(tiny_dir)).__name__ == "LlamaForCausalLM"
