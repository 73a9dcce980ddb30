"""Images in chat prompts: placing a row's images into its messages as TRL 1.16 does, reading them back, and
dropping them for logs.

A message's content is a string or a list of parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``,
``{"type": "image", "image": <PIL image>}``). :func:`place_images` turns string contents into parts; with images
and no empty image placeholder, it puts one ``{"type": "image"}`` part per image before the text of the first user
message; it then fills the empty placeholders, in order, with the images. A count that does not match is an error
naming the row.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def _parts(content: Any) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(part) if isinstance(part, dict) else part for part in content]


def _is_placeholder(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None


def place_images(messages: list[dict], images: list | None, *, row: int | None = None) -> list[dict]:
    """A copy of ``messages`` with every content a list of parts and ``images`` in the image parts (see the module
    docstring). The messages passed in are left as they are."""
    images = list(images or [])
    where = f"row {row}: " if row is not None else ""
    out: list[dict] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ValueError(f"{where}a message has role {role!r}; roles are {', '.join(ROLES)}")
        out.append({**message, "content": _parts(message.get("content"))})
    holes = [(i, j) for i, m in enumerate(out) if m["role"] != "tool"
             for j, part in enumerate(m["content"]) if _is_placeholder(part)]
    if images and not holes:
        first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError(f"{where}{len(images)} image(s) but no user message to put them in")
        out[first_user]["content"] = [{"type": "image"} for _ in images] + out[first_user]["content"]
        holes = [(first_user, j) for j in range(len(images))]
    if len(holes) != len(images):
        raise ValueError(f"{where}the prompt has {len(holes)} image placeholder(s) ({{'type': 'image'}}) but the row "
                         f"has {len(images)} image(s)")
    for (i, j), image in zip(holes, images):
        out[i]["content"][j] = {**out[i]["content"][j], "image": image}
    return out


def prompt_images(messages: list[dict]) -> list:
    """The images inside a prompt's image parts, in order (tool results' included)."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"
            and part.get("image") is not None]


def has_image_parts(messages: Any) -> bool:
    """Whether a conversational prompt has any image part (filled or not)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def strip_images(messages: Any) -> Any:
    """``messages`` with each image part reduced to ``{"type": "image"}`` (for logs and tables); anything that is
    not a list of messages is returned as it is."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def holds_image(value: Any) -> bool:
    """Whether a tool's result or an environment's observation carries an image: a PIL image, or a content part
    ``{"type": "image" | "image_url" | "input_image", ...}``, at any depth of lists, tuples and dicts."""
    if type(value).__module__.startswith("PIL.") and hasattr(value, "getpixel"):
        return True
    if isinstance(value, dict):
        return value.get("type") in IMAGE_PART_TYPES or any(holds_image(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_image(v) for v in value)
    return False

