"""``grpokit train`` / ``grpokit eval`` with images, end to end on a tiny VLM saved to a directory (as a user's local
model): the built-in ``shapes`` task with a LoRA adapter on the language model, a data file naming image files in
full fine-tuning with the vision tower frozen, and images given to a text model refused before it loads."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from tiny_vlm import save_tiny_vlm

from grpokit.cli import main
from grpokit.vision import parameter_parts


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("vlm") / "model")


def spec(model, out, **extra):
    return {"model": str(model), "output_dir": str(out), "per_device_train_batch_size": 4, "num_generations": 2,
            "max_completion_length": 6, "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "use_cpu": True, "learning_rate": 0.05, "eval": {"n": 4, "max_new_tokens": 6, "batch_size": 4}, **extra}


def write_yaml(path, content) -> str:
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_the_shapes_task_trains_a_lora_adapter_on_the_language_model(tmp_path, vlm_dir, capsys):
    out = tmp_path / "run"
    cfg = spec(vlm_dir, out, task="shapes", task_args={"n_train": 8, "n_eval": 4}, lora={"r": 4})
    assert main(["train", write_yaml(tmp_path / "c.yaml", cfg), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["eval_before"]["n"] == 4 and report["eval_after"]["n"] == 4 and report["final_metrics"]["step"] == 2
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    weights = load_file(out / "final" / "adapter_model.safetensors")
    assert weights and all(".language_model." in k and "visual" not in k for k in weights)  # LoRA on the LM only
    assert "language_model" in str(adapter["target_modules"])
    assert (out / "final" / "processor_config.json").is_file()  # the processor travels with the adapter
    assert main(["tasks"]) == 0 and "shapes" in capsys.readouterr().out


def test_a_data_file_naming_pictures_trains_with_the_vision_tower_frozen(tmp_path, vlm_dir, capsys):
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    rows = []
    for i, colour in enumerate(["red", "green", "blue", "white", "black", "yellow", "purple", "orange"]):
        Image.new("RGB", (24 + 4 * i, 32), colour).save(data / "pics" / f"{colour}.png")
        rows.append({"prompt": f"Which colour is this ({i})?", "image": f"pics/{colour}.png", "answer": str(i)})
    (data / "colours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "spread.py").write_text("def distinct(completions, **kw):\n"
                                        "    return [len(set(c[0]['content'])) / 8 for c in completions]\n")
    out = tmp_path / "run"
    cfg = spec(vlm_dir, out, dataset=str(data / "colours.jsonl"), task_args={"n_eval": 4},
               reward_funcs=["spread:distinct"])
    assert main(["train", write_yaml(tmp_path / "c.yaml", cfg)]) == 0
    assert "its vision tower and projector stay frozen" in capsys.readouterr().out
    initial, final = load_file(vlm_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(out / "final")
    parts = parameter_parts(model)
    assert parts["vision"] and parts["projector"]
    visual = [k for k in initial if k.startswith("visual.")]  # the checkpoint's own names for the vision tower
    assert visual and all(torch.equal(initial[k], final[k]) for k in visual)
    assert not torch.equal(initial["model.layers.0.self_attn.q_proj.weight"],
                           final["model.layers.0.self_attn.q_proj.weight"])
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "final"), "--task", "shapes", "-n", "2", "--max-new-tokens", "4"]) == 0
    assert "accuracy" in capsys.readouterr().out  # the trained model's processor came back with it


def test_images_for_a_text_model_are_refused_before_it_loads(tmp_path, tiny_dir, capsys):
    cfg = spec(tiny_dir, tmp_path / "run", task="shapes", task_args={"n_train": 8, "n_eval": 4})
    assert main(["train", write_yaml(tmp_path / "c.yaml", cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has images" in err[0] and "is not a vision-language model" in err[0]
    assert not (tmp_path / "run" / "report.json").exists()
