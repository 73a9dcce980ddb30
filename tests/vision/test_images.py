"""A row's images as PIL images, from every form a dataset holds them in; missing and broken files named."""

from __future__ import annotations

import io

import numpy as np
import pytest
from datasets import Dataset
from datasets import Image as ImageFeature
from PIL import Image

from grpokit.vision.images import batch_images, check_images, image_column, row_images, to_pil


def _png(path, colour="red", size=(8, 6)):
    Image.new("RGB", size, colour).save(path)
    return path


def _pixels(image):
    return np.asarray(image.convert("RGB"))


def test_every_form_of_an_image_value(tmp_path):
    red = _png(tmp_path / "red.png")
    expected = _pixels(Image.open(red))
    data = red.read_bytes()
    values = [Image.open(red), str(red), red, data, bytearray(data), {"bytes": data, "path": None},
              {"bytes": None, "path": str(red)}, expected]
    for value in values:
        assert np.array_equal(_pixels(to_pil(value)), expected), type(value)
    # relative paths are read from base_dir (a data file's folder), also inside a record
    assert np.array_equal(_pixels(to_pil("red.png", base_dir=tmp_path)), expected)
    assert np.array_equal(_pixels(to_pil({"path": "red.png"}, base_dir=tmp_path)), expected)
    # a float array is clipped into bytes; a grey (H, W) array is an image too
    assert to_pil(np.full((4, 5), 300.0)).size == (5, 4)


def test_missing_and_unreadable_images_name_the_row_and_the_file(tmp_path):
    (tmp_path / "notes.png").write_text("not a picture")
    broken = tmp_path / "broken.png"
    broken.write_bytes(_png(tmp_path / "whole.png", size=(64, 64)).read_bytes()[:60])
    cases = [
        ("gone.png", "row 7: image: image file '" + str(tmp_path / "gone.png") + "' does not exist"),
        ("notes.png", "is not an image file PIL can read"),
        ("broken.png", "could not be read"),
        (str(tmp_path), "is a directory"),
        ("https://example.com/a.png", "remote image"),
        (b"\x00\x01", "row 7: image: the image bytes is not an image file"),
        ({"bytes": None, "path": None}, "neither bytes nor a path"),
        (12, "an image is a PIL image, a file path"),
        (np.zeros((2, 2, 2, 2)), "an array of shape (2, 2, 2, 2)"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError) as e:
            to_pil(value, row=7, base_dir=tmp_path)
        assert message in str(e.value) and "\n" not in str(e.value), (value, str(e.value))


def test_row_images_reads_images_before_image_as_trl(tmp_path):
    a, b = _png(tmp_path / "a.png", "red"), _png(tmp_path / "b.png", "blue")
    assert image_column(["prompt", "image"]) == "image" and image_column(["image", "images"]) == "images"
    assert image_column(["prompt"]) is None and image_column(None) is None
    assert row_images({"prompt": "p"}) is None  # a text row
    assert row_images({"image": None}) == [] and row_images({"images": None}) == []
    two = row_images({"images": [str(a), None, str(b)], "image": str(a)})
    assert [_pixels(i)[0, 0].tolist() for i in two] == [[255, 0, 0], [0, 0, 255]]
    assert len(row_images({"images": str(a)})) == 1  # one image where a list was expected
    with pytest.raises(ValueError, match=r"row 3: images\[1\]: image file .*c.png' does not exist"):
        row_images({"images": ["a.png", "c.png"]}, row_index=3, base_dir=tmp_path)


def test_batch_images_is_none_for_a_batch_without_any_image(tmp_path):
    a = _png(tmp_path / "a.png")
    assert batch_images([{"prompt": "x"}, {"prompt": "y"}]) is None
    assert batch_images([{"image": None}, {"image": None}]) is None
    out = batch_images([{"image": None}, {"image": str(a)}])
    assert [len(x) for x in out] == [0, 1]
    with pytest.raises(ValueError, match="row 11: image"):
        batch_images([{"image": "a.png"}, {"image": "nope.png"}], base_dir=tmp_path, first_row=10)


def test_check_images_reads_every_image_before_training(tmp_path):
    a = _png(tmp_path / "a.png")
    good = Dataset.from_dict({"prompt": ["p", "q"], "image": [str(a), str(a)]})
    assert check_images(good) == 2
    assert check_images(Dataset.from_dict({"prompt": ["p"]})) == 0
    bad = Dataset.from_dict({"prompt": ["p", "q", "r"], "images": [[str(a)], [str(a), "missing.png"], []]})
    with pytest.raises(ValueError, match=r"eval_dataset: row 1: images\[1\]: image file .*missing.png"):
        check_images(bad, name="eval_dataset", base_dir=tmp_path)
    assert check_images(bad, limit=1) == 1
    # a 🤗 Image column whose file went missing after the dataset was made: datasets' own decoding error, named
    gone = _png(tmp_path / "gone.png")
    feature = Dataset.from_dict({"prompt": ["p", "q"], "image": [str(a), str(gone)]}).cast_column("image", ImageFeature())
    gone.unlink()
    with pytest.raises(ValueError, match="train_dataset: row 1: its image could not be read"):
        check_images(feature)


def test_a_pil_image_is_returned_as_it_is():
    image = Image.open(io.BytesIO(_png_bytes()))
    assert to_pil(image) is image


def _png_bytes():
    buf = io.BytesIO()
    Image.new("L", (3, 3), 128).save(buf, format="PNG")
    return buf.getvalue()
