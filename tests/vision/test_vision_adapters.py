"""What trains on a VLM: LoRA on the language model only by default; the projector and the vision tower frozen unless
asked; full fine-tuning with the vision side frozen."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import FAMILIES, tiny_vlm

from grpokit.vision.adapters import freeze_vision, language_lora_targets, lora_settings, parameter_parts

peft = pytest.importorskip("peft")

VISION_WORDS = ("visual", "vision", "projector", "connector", "merger")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_lora_is_on_the_language_model_only(family):
    model, _ = tiny_vlm(family)
    parts = parameter_parts(model)
    assert parts["language"] and parts["projector"] and parts["vision"]
    assert "lm_head.weight" in parts["language"] or model.config.get_text_config().tie_word_embeddings
    assert not any(w in n for n in parts["language"] for w in VISION_WORDS)
    decoder_linears = {n for n, m in model.get_decoder().named_modules() if isinstance(m, torch.nn.Linear)}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, **lora_settings(model)))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(w in n for n in trainable for w in VISION_WORDS)
    adapted = {n.split(".lora_")[0] for n in trainable}
    assert len(adapted) == len(decoder_linears)  # every linear layer of the language model, nothing else


def test_projector_and_vision_tower_train_in_full_when_asked():
    model, _ = tiny_vlm("gemma3")
    settings = lora_settings(model, train_projector=True)
    assert settings["modules_to_save"] == ["model.multi_modal_projector"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, **settings))
    saved = [n for n, p in lora.named_parameters() if p.requires_grad and "lora_" not in n]
    assert saved and all("multi_modal_projector.modules_to_save" in n for n in saved)
    model, _ = tiny_vlm("qwen2_vl")
    both = lora_settings(model, train_projector=True, train_vision=True)
    assert both["modules_to_save"][0] == "model.visual.merger" and "model.visual.patch_embed" in both["modules_to_save"]
    assert language_lora_targets(model) == both["target_modules"]
    assert language_lora_targets(model).startswith(r"^model\.language_model\.")


def test_freeze_vision_for_full_fine_tuning():
    model, _ = tiny_vlm("llava")
    parts = parameter_parts(model)
    frozen = freeze_vision(model, projector=False)
    assert frozen == parts["vision"]
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    assert not any(grads[n] for n in parts["vision"]) and all(grads[n] for n in parts["projector"] + parts["language"])
    freeze_vision(model)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in parts["projector"])
