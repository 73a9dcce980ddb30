"""Prompts and their images → left-padded prompt ids, attention mask and the model's image tensors, through the
model's processor and its chat template.

Each prompt is encoded on its own (the processor expands its image markers into the image's tokens), then the rows
are left-padded and their image tensors concatenated (:class:`~grpokit.vision.inputs.VisionInputs`). A
conversational prompt gets its row's images placed as TRL 1.16 places them (:func:`~grpokit.vision.messages.place_images`)
and goes through the chat template with the generation prompt; a plain-text prompt is taken as it is and must hold
the processor's image token once per image.

``max_prompt_length`` cuts a long prompt on the left, as for text, but never into an image: a prompt whose cut would
remove an image token, or the special tokens that open its image block, is refused with an error naming the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..data import is_conversational
from .inputs import VisionInputs
from .messages import place_images, prompt_images


@dataclass
class EncodedPrompts:
    """Prompts ready for generation and the forwards."""

    prompt_ids: torch.Tensor
    """(B, P) left-padded token ids."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on tokens, 0 on padding."""
    vision: VisionInputs | None
    """The image tensors of the B prompts; None when no prompt has an image."""
    images: list[list]
    """Per prompt, its PIL images in order (for reward functions and logs)."""
    truncated: int = 0
    """How many prompts ``max_prompt_length`` cut."""
    texts: list[str] | None = None
    """Per prompt, its text as the processor received it (the chat template applied, image markers unexpanded)."""

    def select(self, rows: Sequence[int]) -> EncodedPrompts:
        rows = [int(r) for r in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        return replace(self, prompt_ids=self.prompt_ids.index_select(0, index),
                       prompt_mask=self.prompt_mask.index_select(0, index),
                       vision=self.vision.select(rows) if self.vision is not None else None,
                       images=[self.images[r] for r in rows],
                       texts=[self.texts[r] for r in rows] if self.texts is not None else None)

    def repeat_interleave(self, g: int) -> EncodedPrompts:
        """Every prompt ``g`` times in a row (its group); the processor ran once per prompt."""
        return self.select([r for r in range(len(self.images)) for _ in range(g)])


def tokenizer_of(processing_class: Any):
    """The tokenizer inside a processor (or the tokenizer itself)."""
    return getattr(processing_class, "tokenizer", processing_class)


def processor_image_token_ids(processing_class: Any) -> set[int]:
    """The ids of the tokens that stand for image content (the processor's and its tokenizer's image tokens)."""
    tok = tokenizer_of(processing_class)
    ids: set[int] = set()
    for owner in (processing_class, tok):
        for name in ("image_token_id", "boi_token_id"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                ids.add(value)
        for name in ("image_token", "boi_token"):
            token = getattr(owner, name, None)
            if isinstance(token, str):
                value = tok.convert_tokens_to_ids(token)
                if isinstance(value, int) and value != tok.unk_token_id:
                    ids.add(value)
    return ids


def image_block_start(ids: Sequence[int], image_ids: set[int], special_ids: set[int],
                      token_types: torch.Tensor | None = None) -> int | None:
    """The first position of the prompt's first image block: its first image token (or first non-zero token type),
    moved left over the special tokens right before it (``<|vision_start|>``, ``<fake_token_around_image>``, ...).
    None when the prompt has no image token."""
    first = next((i for i, t in enumerate(ids) if t in image_ids), None)
    if token_types is not None and bool(token_types.any()):
        typed = int(token_types.nonzero()[0, 0]) + len(ids) - token_types.shape[0]
        first = typed if first is None else min(first, typed)
    if first is None:
        return None
    while first > 0 and ids[first - 1] in special_ids:
        first -= 1
    return first


def _render(processor, prompt: Any, images: list, row: int, chat_template: str | None,
            chat_template_kwargs: dict | None, tools: list | None) -> tuple[str, list, bool]:
    """``(text, images, conversational)`` of one prompt."""
    if is_conversational(prompt):
        messages = place_images(prompt, images, row=row)
        text = processor.apply_chat_template(messages, tools=tools or None, chat_template=chat_template,
                                             tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
        return text, prompt_images(messages), True
    if not isinstance(prompt, str):
        raise ValueError(f"row {row}: prompt {prompt!r:.80} is neither a string nor a list of chat messages")
    if images:
        marker = getattr(processor, "image_token", None)
        found = prompt.count(marker) if isinstance(marker, str) else 0
        if found != len(images):
            raise ValueError(f"row {row}: a plain-text prompt must hold the image token {marker!r} once per image "
                             f"(found {found} for {len(images)} image(s)); or write the prompt as chat messages, which "
                             f"place the images themselves")
    return prompt, list(images), False


def _truncate(ids: list[int], keep: int, vision: VisionInputs | None, row: int, image_ids: set[int],
              special_ids: set[int]) -> tuple[list[int], VisionInputs | None]:
    """The last ``keep`` ids of a prompt (and its token tensors), unless that cuts into an image: an error then."""
    cut = len(ids) - keep
    typed = [vision.tensors[k][0] for k, u in vision.units.items() if u == "token"] if vision is not None else []
    start = image_block_start(ids, image_ids, special_ids, typed[0] if typed else None)
    if start is not None and cut > start:
        raise ValueError(f"row {row}: the prompt has {len(ids)} tokens, more than max_prompt_length={keep}, and cutting "
                         f"it on the left would cut into its image (which starts at token {start}); raise "
                         f"max_prompt_length to at least {len(ids)} or shorten the text before the image")
    if vision is not None:
        vision = replace(vision, tensors={k: (t[:, cut:] if vision.units[k] == "token" else t)
                                          for k, t in vision.tensors.items()},
                         token_width=min(vision.token_width, keep))
    return ids[cut:], vision


def _encode_one(processor, prompt: Any, images: list, row: int, *, max_prompt_length: int | None,
                chat_template: str | None, chat_template_kwargs: dict | None, tools: list | None,
                image_ids: set[int], special_ids: set[int]) -> tuple[list[int], VisionInputs | None, list, bool, str]:
    """One prompt: ``(ids, image tensors or None, its images, whether max_prompt_length cut it, its text)``."""
    text, imgs, conv = _render(processor, prompt, images, row, chat_template, chat_template_kwargs, tools)
    out = processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt", add_special_tokens=not conv)
    ids = out["input_ids"][0].tolist()
    vision = VisionInputs.from_processor_output(out, [len(imgs)]) if imgs else None
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        ids, vision = _truncate(ids, max_prompt_length, vision, row, image_ids, special_ids)
        return ids, vision, imgs, True, text
    return ids, vision, imgs, False, text


def _left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def _token_sets(processor) -> tuple[int, set[int], set[int]]:
    tok = tokenizer_of(processor)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return pad_id, processor_image_token_ids(processor), set(tok.all_special_ids)


def encode_prompts(
    processor: Any,
    prompts: Sequence[Any],
    images: Sequence[Sequence | None] | None = None,
    *,
    max_prompt_length: int | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    tools: list | None = None,
    first_row: int = 0,
) -> EncodedPrompts:
    """Encode ``prompts`` (with ``images[i]`` for prompt ``i``: PIL images, or None) for the model of ``processor``
    (see the module docstring). ``first_row`` numbers the rows in error messages (the dataset row of prompt 0)."""
    pad_id, image_ids, special_ids = _token_sets(processor)
    images = list(images) if images is not None else [None] * len(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    rows, parts, row_images, truncated, texts = [], [], [], 0, []
    for i, (prompt, imgs) in enumerate(zip(prompts, images)):
        ids, vision, imgs, cut, text = _encode_one(processor, prompt, list(imgs or []), first_row + i,
                                             max_prompt_length=max_prompt_length, chat_template=chat_template,
                                             chat_template_kwargs=chat_template_kwargs, tools=tools,
                                             image_ids=image_ids, special_ids=special_ids)
        rows.append(ids)
        parts.append(vision)
        row_images.append(imgs)
        truncated += cut
        texts.append(text)
    ids, mask = _left_padded(rows, pad_id)
    return EncodedPrompts(ids, mask, VisionInputs.cat(parts, [1] * len(parts)), row_images, truncated, texts)


def _same_value(a: Any, b: Any) -> bool:
    """Whether two dataset values are the same (images: the same file name, bytes or pixels)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # arrays: element-wise comparison
        return False


def row_runs(rows: Sequence[dict], tools_per_row: Sequence[Sequence] | None = None) -> list[int]:
    """For each row, the index of the first row of its run: consecutive rows with the same prompt, the same images
    and the same tools (the ``G`` rows of a group) are one prompt, encoded once."""
    from .images import image_column

    firsts: list[int] = []
    for i, row in enumerate(rows):
        if i:
            prev = rows[firsts[-1]]
            column = image_column(list(row))
            same = (column == image_column(list(prev)) and _same_value(row.get("prompt"), prev.get("prompt"))
                    and (column is None or _same_value(row.get(column), prev.get(column))))
            if same and tools_per_row is not None:
                same = [t.__name__ for t in tools_per_row[i]] == [t.__name__ for t in tools_per_row[firsts[-1]]]
            if same:
                firsts.append(firsts[-1])
                continue
        firsts.append(i)
    return firsts


def encode_batch(processor: Any, rows: Sequence[dict], *, tools_per_row: Sequence[Sequence] | None = None,
                 max_prompt_length: int | None = None, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None, base_dir: Any = None) -> EncodedPrompts:
    """A generation batch's rows (each with a ``prompt`` and its ``image`` / ``images``) encoded through the processor:
    each run of identical consecutive rows (:func:`row_runs`: a group) read and encoded once, its image tensors then
    repeated for its rows. ``tools_per_row``: each row's tools (rendered into its prompt by the chat template). Errors
    name the row of the batch."""
    from .images import row_images

    pad_id, image_ids, special_ids = _token_sets(processor)
    firsts = row_runs(rows, tools_per_row)
    starts = sorted(set(firsts))
    encoded: dict[int, tuple] = {}
    for i in starts:
        imgs = row_images(rows[i], row_index=i, base_dir=base_dir) or []
        encoded[i] = _encode_one(processor, rows[i]["prompt"], imgs, i, max_prompt_length=max_prompt_length,
                                 chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                 tools=tools_per_row[i] if tools_per_row is not None else None,
                                 image_ids=image_ids, special_ids=special_ids)
    ids, mask = _left_padded([encoded[i][0] for i in starts], pad_id)
    vision = VisionInputs.cat([encoded[i][1] for i in starts], [1] * len(starts))
    unique = EncodedPrompts(ids, mask, vision, [encoded[i][2] for i in starts],
                            sum(encoded[i][3] for i in starts), [encoded[i][4] for i in starts])
    position = {start: k for k, start in enumerate(starts)}
    out = unique.select([position[f] for f in firsts])
    out.truncated = sum(encoded[f][3] for f in firsts)
    return out


def encode_rows(processor: Any, rows: Sequence[dict], *, group_size: int = 1, max_prompt_length: int | None = None,
                chat_template: str | None = None, chat_template_kwargs: dict | None = None, tools: list | None = None,
                base_dir: Any = None, first_row: int = 0) -> EncodedPrompts:
    """Dataset rows (each with a ``prompt`` and its ``image`` / ``images``) encoded as the trainer's generation batch
    holds them: ``group_size`` consecutive rows per prompt, the processor running once per group."""
    from .images import batch_images

    if group_size < 1 or len(rows) % group_size:
        raise ValueError(f"{len(rows)} rows do not make whole groups of {group_size}")
    unique = list(rows[::group_size])
    images = batch_images(unique, base_dir=base_dir, first_row=first_row)
    encoded = encode_prompts(processor, [r["prompt"] for r in unique], images, max_prompt_length=max_prompt_length,
                             chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools,
                             first_row=first_row)
    return encoded.repeat_interleave(group_size) if group_size > 1 else encoded
