"""The completions table with a VLM's pictures: an ``image`` column of wandb images (TRL's), each row's own, also when
only the first row of each prompt is kept."""

from __future__ import annotations

from PIL import Image

from grpokit.reporting.tables import completions_frame, with_images


def test_the_wandb_table_gets_each_rows_pictures():
    import wandb

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    prompts, images = ["a", "a", "b", "b"], [[red], [red], [blue, red], [blue, red]]
    frame = completions_frame(3, prompts, ["x", "y", "z", "w"], {"r": [1, 0, 1, 0]}, [1, -1, 1, -1],
                              unique_prompts=True)
    table = with_images(frame, images, wandb.Image)
    assert list(table.index) == [0, 2] and [len(c) for c in table["image"]] == [1, 2]
    assert all(isinstance(i, wandb.Image) for c in table["image"] for i in c)
    assert wandb.Table(dataframe=table).columns[-1] == "image"
    assert "image" not in frame  # the parquet file keeps TRL's columns
