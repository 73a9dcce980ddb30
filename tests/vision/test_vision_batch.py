"""The typed hand-offs carry the images: a generation batch's rows encoded through the processor (each group once),
``ScoredSamples`` and ``RolloutBatch`` selecting, concatenating, splitting and moving their image tensors with their
rows, and the rollout buffer's checkpoint holding them (a resume mid generation batch trains on the same pictures)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_vlm import shared_tiny_vlm

from grpokit.batch import RolloutBatch, RolloutBuffer
from grpokit.pipeline import prompt_key
from grpokit.pipeline.samples import ScoredSamples, prepare_prompts
from grpokit.rollout.base import Generation
from grpokit.run.checkpoint_parts import load_parts, save_parts
from grpokit.vision.encoding import encode_batch, encode_prompts, row_runs

RED, BLUE, GREEN = (Image.new("RGB", (40, 30), "red"), Image.new("RGB", (50, 70), "blue"),
                    Image.new("RGB", (32, 32), "green"))
Q = [{"role": "user", "content": "What colour?"}]


def _rows(g=2):
    """Three groups of ``g``: the same question about red, then blue, then a text-only question."""
    return ([{"prompt": Q, "image": RED, "answer": "red"}] * g + [{"prompt": Q, "image": BLUE, "answer": "blue"}] * g
            + [{"prompt": [{"role": "user", "content": "Hi"}], "image": None, "answer": ""}] * g)


class CountingProcessor:
    """A processor whose calls are counted (everything else is the real one's)."""

    def __init__(self, processor):
        self.inner, self.calls = processor, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "gemma3"])  # patch, row and token units
def test_a_batch_is_encoded_once_per_group_as_each_row_alone(family):
    _, processor = shared_tiny_vlm(family)
    rows = _rows(g=3)
    assert row_runs(rows) == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    counting = CountingProcessor(processor)
    enc = encode_batch(counting, rows)
    assert counting.calls == 3  # the processor ran once per group
    alone = encode_prompts(processor, [r["prompt"] for r in rows], [[r["image"]] if r["image"] else None for r in rows])
    assert torch.equal(enc.prompt_ids, alone.prompt_ids) and torch.equal(enc.prompt_mask, alone.prompt_mask)
    assert enc.vision.images_per_row == [1, 1, 1, 1, 1, 1, 0, 0, 0]
    for k, t in alone.vision.tensors.items():
        assert torch.equal(enc.vision.tensors[k], t), k
    assert enc.images[0][0] is RED and enc.images[3][0] is BLUE and enc.images[6] == []
    assert enc.texts[0] == alone.texts[0] and "<|im_start|>assistant" in enc.texts[0]


def test_rows_differing_in_tools_or_pictures_are_not_one_group():
    def add(a: int) -> int:
        """Add.

        Args:
            a: a number.
        """
        return a

    rows = [{"prompt": Q, "image": RED}, {"prompt": Q, "image": RED}, {"prompt": Q, "image": Image.new("RGB", (40, 30),
                                                                                                     "red")}]
    assert row_runs(rows) == [0, 0, 0]  # equal pixels are the same picture
    assert row_runs(rows, [[], [add], [add]]) == [0, 1, 1]
    assert row_runs([{"prompt": Q, "image": "a.png"}, {"prompt": Q, "image": "b.png"}]) == [0, 1]
    with pytest.raises(ValueError, match=r"row 1: image: image file .missing.png. does not exist"):
        encode_batch(shared_tiny_vlm("qwen2_vl")[1], [{"prompt": Q, "image": RED}, {"prompt": Q, "image": "missing.png"}])


def test_prepared_prompts_give_rewards_the_images_and_generation_the_tensors():
    _, processor = shared_tiny_vlm("qwen2_vl")
    prepared = prepare_prompts(_rows(), processor, dtype=torch.float64)
    assert prepared.vision.tensors["pixel_values"].dtype == torch.float64
    assert set(prepared.batch.backend_kwargs()) == {"vision", "images"}
    placed = prepared.reward_prompts[2][0]["content"]
    assert placed[0]["type"] == "image" and placed[0]["image"] is BLUE and placed[1] == {"type": "text",
                                                                                        "text": "What colour?"}
    assert prepared.reward_prompts[4] == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert prepared.prompts[0] is Q  # the dataset's prompts are left as they are
    text_only = prepare_prompts(_rows()[4:], processor)  # a VLM's text-only batch: a plain text batch
    assert text_only.vision is None and text_only.images is None and text_only.batch.backend_kwargs() == {}
    assert text_only.reward_prompts == text_only.prompts


def _scored(processor, rows, seed):
    prepared = prepare_prompts(rows, processor)
    n = len(rows)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (n, 3 + seed), generator=gen)
    generation = Generation(ids, torch.ones_like(ids), torch.zeros(n, dtype=torch.bool))
    return ScoredSamples(prompts=prepared.prompts, prompt_texts=prepared.texts, prompt_ids=prepared.ids,
                         prompt_mask=prepared.mask, generation=generation, completion_texts=[""] * n,
                         completions=[""] * n, completion_id_lists=ids.tolist(), rewards=torch.zeros(n, 1),
                         n_truncated_prompts=0, vision=prepared.vision, images=prepared.images)


def _pixels_of(vision, row):
    return vision.select([row]).tensors["pixel_values"]


def test_scored_samples_keep_each_rows_pictures_through_select_and_concat():
    _, processor = shared_tiny_vlm("qwen2_vl")
    a, b = _scored(processor, _rows(), 0), _scored(processor, _rows()[4:], 1)  # the second part has no image
    both = ScoredSamples.concat([a.select([2, 3, 0]), b], pad_id=0)
    assert len(both) == 5 and both.vision.images_per_row == [1, 1, 1, 0, 0]
    assert torch.equal(_pixels_of(both.vision, 0), _pixels_of(a.vision, 2))
    assert torch.equal(_pixels_of(both.vision, 2), _pixels_of(a.vision, 0))
    assert both.images[0][0] is BLUE and both.images[2][0] is RED and both.images[3:] == [[], []]
    # the prompts were re-padded on the left: the token types still end where each prompt ends
    types = both.vision.fit_tokens(both.prompt_ids.shape[1])["mm_token_type_ids"]
    assert torch.equal(types[0][both.prompt_mask[0].bool()], a.vision.fit_tokens(a.prompt_ids.shape[1])[
        "mm_token_type_ids"][2][a.prompt_mask[2].bool()])
    assert ScoredSamples.concat([b, b], pad_id=0).vision is None


def _batch(processor):
    s = _scored(processor, _rows(), 0)
    n = len(s)
    return RolloutBatch(prompt_ids=s.prompt_ids, prompt_mask=s.prompt_mask, completion_ids=s.generation.completion_ids,
                        completion_mask=s.generation.completion_mask, advantages=torch.arange(n, dtype=torch.float32),
                        num_items_in_batch=torch.tensor(7.0), old_logps=torch.randn(n, 3), vision=s.vision)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "gemma3"])
def test_rollout_batches_split_and_move_their_pictures_with_their_rows(family):
    _, processor = shared_tiny_vlm(family)
    batch = _batch(processor)
    parts = batch.split(3)
    assert [p.vision.images_per_row for p in parts] == [[1, 1], [1, 1], [0, 0]]
    for k, t in parts[1].vision.tensors.items():
        assert torch.equal(t, batch.vision.select([2, 3]).tensors[k]), k
    picked = batch.select(torch.tensor([5, 0]))
    assert picked.vision.images_per_row == [0, 1] and picked.advantages.tolist() == [5.0, 0.0]
    masked = batch.select(torch.tensor([False, False, True, False, False, True]))
    assert masked.vision.images_per_row == [1, 0] and masked.advantages.tolist() == [2.0, 5.0]
    moved = batch.to("cpu")
    assert moved.vision is not batch.vision and moved.vision.images_per_row == batch.vision.images_per_row
    back = RolloutBatch.from_tensors(batch.state())
    assert back.vision.layout() == batch.vision.layout()
    assert all(torch.equal(back.vision.tensors[k], t) for k, t in batch.vision.tensors.items())
    with pytest.raises(ValueError, match="not fields of RolloutBatch"):
        RolloutBatch.from_tensors({**batch.state(), "pixels": torch.zeros(1)})


def test_a_checkpoint_mid_generation_batch_holds_the_pictures(tmp_path):
    _, processor = shared_tiny_vlm("qwen2_vl")
    batch = _batch(processor)
    buffer = RolloutBuffer(steps_per_generation=3, generate_every=3)
    buffer.fill(batch)
    buffer.next()  # one micro-batch served: a checkpoint now falls inside the generation batch
    save_parts([buffer], tmp_path)
    resumed = RolloutBuffer(steps_per_generation=3, generate_every=3)
    resumed.reset(1)
    load_parts([resumed], tmp_path)
    for original, loaded in zip(buffer.parts, resumed.parts):
        assert loaded.vision is not None or original.vision.num_images == 0
        assert loaded.vision.layout() == original.vision.layout()
        for k, t in original.vision.tensors.items():
            assert torch.equal(loaded.vision.tensors[k], t), k
        assert torch.equal(loaded.prompt_ids, original.prompt_ids)
    assert resumed.next().vision.images_per_row == [1, 1]  # micro-step 1: the blue group, as the first run would


def test_prompt_skipping_keys_a_prompt_by_its_picture_too():
    assert prompt_key(Q, [RED]) != prompt_key(Q, [BLUE]) != prompt_key(Q)
    assert prompt_key(Q, [RED]) == prompt_key(Q, [Image.new("RGB", (40, 30), "red")])
    assert prompt_key(Q, None) == prompt_key(Q, [])
