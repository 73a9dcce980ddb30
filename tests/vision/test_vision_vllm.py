"""The vLLM backend sends a VLM's prompts with their images: vLLM's multimodal data in colocate mode, the server's
image features placed at each prompt's image tokens in server mode (fakes with vLLM's and TRL-client's surfaces)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from runs import first_loss_inputs
from tiny_vlm import shared_tiny_vlm, tiny_vlm

from grpokit.config import GRPOConfig
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.vllm_backend import VLLMRollout, place_image_features
from grpokit.vision.encoding import encode_prompts

RED, BLUE = Image.new("RGB", (40, 30), "red"), Image.new("RGB", (50, 70), "blue")


class FakeLLM:
    def __init__(self):
        self.requests = []

    def generate(self, requests, sampling_params, use_tqdm):
        self.requests.append(requests)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[11, 2], logprobs=[{11: SimpleNamespace(logprob=-1.0)},
                                                                                     {2: SimpleNamespace(logprob=-0.5)}],
                                                         finish_reason="stop")]) for _ in requests]


class FakeClient:
    """TRL's VLLMClient: image_features() renders images alone (placeholders where the throwaway conversation had
    them), generate() takes token ids and those features."""

    def __init__(self):
        self.feature_requests, self.requests = [], []

    def image_features(self, images):
        self.feature_requests.append(images)
        return [None if not imgs else {"mm_hashes": [f"h{i}" for i in range(len(imgs))],
                                       "mm_placeholders": {"image": [{"offset": 99, "length": 1}] * len(imgs)}}
                for imgs in images]

    def generate(self, prompts, n=1, generation_kwargs=None, features=None, **kw):
        self.requests.append((prompts, features))
        return {"completion_ids": [[11, 2]] * len(prompts), "logprobs": [[[-1.0], [-0.5]]] * len(prompts)}


def _args(tmp_path, mode, **kw):
    return GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode=mode, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, report_to="none", use_cpu=True, **kw)


def _batch(processor):
    enc = encode_prompts(processor, [[{"role": "user", "content": "One?"}], [{"role": "user", "content": "Two?"}],
                                     [{"role": "user", "content": "None?"}]], [[RED], [RED, BLUE], None])
    return enc.repeat_interleave(2)


def test_colocate_sends_images_as_multimodal_data(tmp_path):
    _, processor = shared_tiny_vlm("qwen2_vl")
    enc = _batch(processor)
    llm = FakeLLM()
    backend = VLLMRollout("unused", processor, _args(tmp_path, "colocate"), llm=llm, sampling_params_cls=dict)
    out = backend.generate(None, enc.prompt_ids, enc.prompt_mask, SamplingParams(max_new_tokens=4), images=enc.images)
    sent = llm.requests[0]
    assert [r.get("multi_modal_data") for r in sent] == [{"image": RED}] * 2 + [{"image": [RED, BLUE]}] * 2 + [None] * 2
    assert sent[0]["prompt_token_ids"] == enc.prompt_ids[0][enc.prompt_mask[0].bool()].tolist()
    assert out.completion_ids.shape == (6, 2)
    backend.generate(None, enc.prompt_ids, enc.prompt_mask, SamplingParams(max_new_tokens=4))  # a text batch
    assert all("multi_modal_data" not in r for r in llm.requests[1])


def test_server_places_image_features_at_each_prompts_image_tokens(tmp_path):
    _, processor = shared_tiny_vlm("qwen2_vl")
    enc = _batch(processor)
    client = FakeClient()
    backend = VLLMRollout("unused", processor, _args(tmp_path, "server"), client=client)
    assert backend.tokenizer is processor.tokenizer and backend.image_token_id == processor.image_token_id
    backend.generate(None, enc.prompt_ids, enc.prompt_mask, SamplingParams(max_new_tokens=4), images=enc.images)
    assert client.feature_requests == [enc.images]
    prompts, features = client.requests[0]
    for ids, feats, images in zip(prompts, features, enc.images):
        if not images:
            assert feats is None
            continue
        runs = feats["mm_placeholders"]["image"]
        assert len(runs) == len(images) and feats["mm_hashes"] == [f"h{i}" for i in range(len(images))]
        for run in runs:  # each run covers exactly one image's tokens
            span = ids[run["offset"]:run["offset"] + run["length"]]
            assert set(span) == {processor.image_token_id}
            assert ids[run["offset"] - 1] != processor.image_token_id
    with pytest.raises(ValueError, match="row 3: the prompt has 1 run"):
        place_image_features({"mm_placeholders": {"image": [{}, {}]}}, [1, 4, 4, 1], 4, row=3)
    with pytest.raises(ValueError, match="needs the model's processor"):
        place_image_features({"mm_placeholders": {"image": [{}]}}, [4], None)
    assert place_image_features(None, [1, 2], 4) is None


def test_the_trainer_sends_each_rows_pictures_to_the_engine(tmp_path):
    """Through GRPOTrainer (use_vllm, colocate): the generation batch's rows go to the engine with their images, and
    the loss's forward, which gives the trainer's side of the mismatch correction on-policy, sees them."""
    from datasets import Dataset

    from grpokit import GRPOTrainer

    model, processor = tiny_vlm("qwen2_vl")
    llm = FakeLLM()
    args = _args(tmp_path, "colocate", max_steps=1, save_strategy="no")  # one generation: no weights to sync
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "One?"}], [{"role": "user", "content": "Two?"}]],
                              "image": [RED, BLUE]})
    trainer = GRPOTrainer(model, lambda completions, **kw: [1.0] * len(completions), args=args, train_dataset=data,
                          processing_class=processor,
                          rollout_backend=VLLMRollout("unused", processor, args, llm=llm, sampling_params_cls=dict))
    first_policy = copy.deepcopy(model)
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    batch = seen["batch"]
    sent = [r["multi_modal_data"]["image"] for r in llm.requests[0]]
    assert sorted(img.size for img in sent) == sorted([RED.size, RED.size, BLUE.size, BLUE.size])
    assert batch.vision is not None and batch.vision.images_per_row == [1, 1, 1, 1]
    assert batch.sampler_logps is not None and batch.old_logps is None  # on-policy: the loss's forward is the trainer's
    from grpokit.algorithms.importance import SamplerCorrection
    from grpokit.forward.logprobs import completion_logps

    with torch.no_grad():
        blind, _ = completion_logps(first_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                    batch.completion_mask)
        seeing, _ = completion_logps(first_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                     batch.completion_mask, vision=batch.vision)
    correction = SamplerCorrection.from_config(args)
    torch.testing.assert_close(seen["logps"], seeing)  # the loss's forward was taken with the pictures
    assert not torch.allclose(seen["logps"], blind)
    want, _ = correction(seeing, batch.sampler_logps, batch.loss_mask)
    torch.testing.assert_close(seen["sampler_ratio"], want)
