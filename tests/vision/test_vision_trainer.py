"""GRPOTrainer with images, through the path users run: tiny random VLMs of every family built offline, a dataset
with an ``image`` column, real generation (transformers ``generate``) and training steps. The images reach every
forward (every trainable parameter moves, the vision tower's included), the rewards, generation (every turn), the
old / reference / behaviour log-probs, dynamic sampling's refill rows, evaluation and a resumed run."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from PIL import Image
from runs import make_args, params_of, train_logs, varied_reward
from tiny_vlm import FAMILIES, save_tiny_vlm, tiny_vlm

import grpokit.forward.logprobs
import grpokit.pipeline.producer
from grpokit import GRPOTrainer
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.vision import is_processor, parameter_parts

COLOURS = ["red", "blue", "green", "yellow", "white", "black", "purple", "orange"]


def image_dataset(n: int = 4, size=(32, 40)) -> Dataset:
    """``n`` questions, each about its own picture (a plain colour, sizes varying)."""
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What colour is picture {i}?"}] for i in range(n)],
        "image": [Image.new("RGB", (size[0] + 8 * (i % 3), size[1]), COLOURS[i % len(COLOURS)]) for i in range(n)],
        "answer": [COLOURS[i % len(COLOURS)] for i in range(n)],
    })


class RecordingRollout(TransformersRollout):
    """transformers ``generate`` (the default backend), recording what each call was given."""

    def __init__(self, processor):
        super().__init__(processor.tokenizer)
        self.calls: list[dict] = []

    def generate(self, model, prompt_ids, prompt_mask, params, vision=None, images=None):
        self.calls.append({"rows": prompt_ids.shape[0], "width": prompt_ids.shape[1], "vision": vision,
                           "images": images})
        return super().generate(model, prompt_ids, prompt_mask, params, vision=vision, images=images)


def seen_rewards(log: list):
    """A reward with spread in every group that records the images and prompts it received."""

    def reward(completions, prompts, image, **kw):
        log.append({"image": list(image), "prompts": list(prompts)})
        return varied_reward(completions)

    return reward


def trainer_for(tmp_path, family="qwen2_vl", dataset=None, reward=varied_reward, rollout=True, seed=0, eval_dataset=None,
                **kw):
    model, processor = tiny_vlm(family, seed=seed)
    args = make_args(tmp_path, **{"per_device_train_batch_size": 4, "num_generations": 2, "learning_rate": 0.1, **kw})
    backend = RecordingRollout(processor) if rollout else None
    trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset if dataset is not None else image_dataset(),
                          eval_dataset=eval_dataset, processing_class=processor, rollout_backend=backend)
    return trainer, backend


# LLaVA's vision_feature_layer=-2 leaves its last vision layer and post_layernorm without gradient (as TRL's tests say)
NEVER_TRAINED = {"llava": ("encoder.layers.1.", "post_layernorm"), "llava_next": ("encoder.layers.1.", "post_layernorm")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_steps_move_every_trainable_parameter(tmp_path, family):
    log: list = []
    trainer, backend = trainer_for(tmp_path, family, reward=seen_rewards(log))
    before = params_of(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2 and len(train_logs(trainer)) == 2
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    expected = [n for n in before if "vision_tower" in n and any(s in n for s in NEVER_TRAINED.get(family, ()))]
    assert unchanged == expected, unchanged[:5]
    assert parameter_parts(trainer.model)["vision"]  # the vision tower is among what moved
    # generation got each row's image tensors; rewards got the images (the column and inside the prompts)
    assert all(c["vision"] is not None and c["vision"].rows == c["rows"] == 4 for c in backend.calls)
    first = log[0]
    assert [img.size for img in first["image"]] == [(img.size) for img in (r[0]["content"][0]["image"] for r in
                                                                           first["prompts"])]
    assert first["prompts"][0][0]["content"][1] == {"type": "text", "text": first["prompts"][0][0]["content"][1]["text"]}


def test_a_model_directory_loads_with_its_processor_and_freeze_vision_keeps_the_tower(tmp_path):
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "model")
    args = make_args(tmp_path, per_device_train_batch_size=4, num_generations=2, learning_rate=0.1, freeze_vision=True)
    trainer = GRPOTrainer(str(path), varied_reward, args=args, train_dataset=image_dataset())
    assert is_processor(trainer.processing_class) and trainer.processing_class.tokenizer.padding_side == "left"
    assert trainer.args.ddp_find_unused_parameters is True  # TRL's rule for a VLM
    before = params_of(trainer.model)
    trainer.train()
    parts = parameter_parts(trainer.model)
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(parts["language"])
    assert not moved & set(parts["vision"] + parts["projector"])


def test_images_that_cannot_reach_the_model_stop_before_training(tmp_path):
    from tiny import tiny_model, tiny_tokenizer

    args = make_args(tmp_path, per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(ValueError, match=r"train_dataset has images .* text-only model"):
        GRPOTrainer(tiny_model(), varied_reward, args=args, train_dataset=image_dataset(),
                    processing_class=tiny_tokenizer())
    model, processor = tiny_vlm("qwen2_vl")
    with pytest.raises(ValueError, match=r"processing_class is \w+, not the model's processor"):
        GRPOTrainer(model, varied_reward, args=args, train_dataset=image_dataset(), processing_class=processor.tokenizer)
    Image.new("RGB", (8, 8), "red").save(tmp_path / "pic.png")
    paths = [str(tmp_path / "pic.png")] * 4
    paths[2] = str(tmp_path / "gone.png")
    missing = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Colour?"}]] * 4, "image": paths})
    with pytest.raises(ValueError, match=r"train_dataset: row 2: image: image file '.*gone.png' does not exist"):
        GRPOTrainer(model, varied_reward, args=args, train_dataset=missing, processing_class=processor)
    with pytest.raises(ValueError, match="rollout_func does not support"):
        GRPOTrainer(model, varied_reward, args=args, train_dataset=image_dataset(), processing_class=processor,
                    rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="freeze_vision=True is not allowed: .* is not a vision-language model"):
        GRPOTrainer(tiny_model(), varied_reward, args=make_args(tmp_path, freeze_vision=True),
                    train_dataset=Dataset.from_dict({"prompt": ["hi"] * 16}), processing_class=tiny_tokenizer())


def test_max_prompt_length_never_cuts_an_image(tmp_path):
    trainer, _ = trainer_for(tmp_path, max_prompt_length=12, max_steps=1)
    with pytest.raises(ValueError, match=r"more than max_prompt_length=12, and cutting it on the left would cut into "
                                         r"its image"):
        trainer.train()


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])  # M-RoPE positions; token types and bidirectional images
def test_the_shared_prompt_path_equals_the_unshared_one_through_the_trainer(tmp_path, family, monkeypatch):
    shared_calls = []
    real = grpokit.forward.logprobs._shared_prompt_head_inputs
    monkeypatch.setattr(grpokit.forward.logprobs, "_shared_prompt_head_inputs",
                        lambda *a, **k: shared_calls.append(1) or real(*a, **k))
    updates, losses = {}, {}
    for share in (True, False):
        monkeypatch.setattr(grpokit.forward.logprobs, "SHARE_PROMPTS_ON", ("cpu",) if share else ())
        # plain SGD: the weights move by the gradients themselves (Adam's first step would amplify float noise)
        trainer, _ = trainer_for(tmp_path / str(share), family, num_generations=4, optim="sgd", learning_rate=1.0,
                                 steps_per_generation=2, max_steps=2)
        before = params_of(trainer.model)
        trainer.train()
        updates[share] = {n: p - before[n] for n, p in params_of(trainer.model).items()}
        losses[share] = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert shared_calls  # the groups' prompts, their images included, were encoded once per group
    scale = max(u.abs().max().item() for u in updates[False].values())
    assert scale > 1e-3
    for n, u in updates[False].items():  # two steps' updates of every parameter, up to float rounding
        assert (updates[True][n] - u).abs().max().item() <= 1e-5 * scale, n
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-7)


def test_asynchronous_rollouts_score_with_the_images(tmp_path, monkeypatch):
    seen = []
    real = grpokit.pipeline.producer.completion_logps

    def behaviour_logps(model, *rows, vision=None, **kw):
        seen.append(vision)
        return real(model, *rows, vision=vision, **kw)

    monkeypatch.setattr(grpokit.pipeline.producer, "completion_logps", behaviour_logps)
    trainer, backend = trainer_for(tmp_path, dataset=image_dataset(8), max_staleness=1, staleness_mode="exact",
                                   max_steps=3)
    trainer.train()
    logs = train_logs(trainer)
    assert len(logs) == 3 and [h["sample/staleness_mean"] for h in logs] == [0.0, 1.0, 1.0]
    assert len(seen) >= 3 and all(v is not None and v.rows == 4 for v in seen)
    assert all(c["vision"] is not None for c in backend.calls)  # the producer's copy generated with the images


def test_dynamic_sampling_refills_rows_with_their_images(tmp_path):
    log = []

    def reward(completions, image, **kw):  # red and blue pictures: no spread (dropped); the others: spread
        log.append(list(image))
        tied = [img.getpixel((0, 0)) in ((255, 0, 0), (0, 0, 255)) for img in image]
        return [0.0 if t else v for t, v in zip(tied, varied_reward(completions))]

    trainer, backend = trainer_for(tmp_path, dataset=image_dataset(8), reward=reward, dynamic_sampling=True,
                                   max_steps=1, shuffle_dataset=False)
    trainer.train()
    (h,) = train_logs(trainer)
    assert h["dynamic_sampling/rounds"] == 2 and h["dynamic_sampling/filtered_frac"] > 0
    refill = backend.calls[1]
    assert refill["vision"] is not None and refill["vision"].rows == refill["rows"]
    # each refill row was encoded with its own picture: what generation got is what the reward saw
    assert [imgs[0] for imgs in refill["images"]] == log[1]


def test_a_run_resumed_mid_generation_batch_trains_on_the_same_pictures(tmp_path):
    full, _ = trainer_for(tmp_path / "full", steps_per_generation=2, max_steps=2, learning_rate=0.05,
                          save_strategy="steps", save_steps=1)
    full.train()
    ckpt = tmp_path / "full" / "out" / "checkpoint-1"
    from safetensors import safe_open

    with safe_open(str(ckpt / "grpokit_rollouts.safetensors"), "pt") as f:
        assert any(k.startswith("0/vision/") for k in f.keys())  # the unconsumed micro-batch's image tensors
    resumed, backend = trainer_for(tmp_path / "resumed", seed=7, steps_per_generation=2, max_steps=2,
                                   learning_rate=0.05)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert backend.calls == []  # step 2 trained on the saved micro-batch: nothing was generated again
    final, resumed_params = params_of(full.model), params_of(resumed.model)
    for n, p in final.items():
        assert torch.equal(p, resumed_params[n]), n


def test_evaluation_and_old_and_reference_logps_see_the_images(tmp_path):
    seen = []

    class Spy:
        def __init__(self, driver):
            self.driver = driver

        def __getattr__(self, name):
            return getattr(self.driver, name)

        def policy_logps(self, *rows, vision=None):
            seen.append(("old", vision))
            return self.driver.policy_logps(*rows, vision=vision)

        def reference_logps(self, *rows, vision=None):
            seen.append(("ref", vision))
            return self.driver.reference_logps(*rows, vision=vision)

    trainer, backend = trainer_for(tmp_path, beta=0.1, steps_per_generation=2, max_steps=2, eval_strategy="steps",
                                   eval_steps=1, per_device_eval_batch_size=4, num_generations_eval=2,
                                   eval_dataset=image_dataset(4))
    trainer.driver = Spy(trainer.driver)
    trainer.train()
    assert {k for k, _ in seen} == {"old", "ref"} and all(v is not None and v.num_images for _, v in seen)
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert evals and all(c["vision"] is not None for c in backend.calls)


def test_log_multimodal_puts_the_pictures_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _ = trainer_for(tmp_path, max_steps=1, log_completions=True, report_to="tensorboard")
    trainer.train()
    runs = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    tags = set()
    for r in runs:
        acc = EventAccumulator(str(r.parent))
        acc.Reload()
        tags |= set(acc.Tags()["images"])
    assert {t for t in tags if t.startswith("completions/image/")} == {"completions/image/0_0", "completions/image/2_0"}
    (tmp_path / "b").mkdir()
    trainer, _ = trainer_for(tmp_path / "b", max_steps=1, log_completions=True, report_to="tensorboard",
                             log_multimodal=False)
    trainer.train()
    for r in (tmp_path / "b").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(r.parent))
        acc.Reload()
        assert not acc.Tags()["images"]
