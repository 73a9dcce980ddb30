"""Tasks from local JSONL / CSV / Parquet files."""

from __future__ import annotations

import json

import pytest

from grpokit.rewards import correctness, format_reward
from grpokit.tasks import ANSWER_INSTRUCTION, get_task, load_dataset_file

GSM8K_ROWS = [
    {"question": f"Question {i}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"}
    for i in range(20)
] + [{"question": "Big one?", "answer": "So.\n#### 1,234"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_gsm8k_style(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    ds = load_dataset_file(path, prompt_column="question")
    assert len(ds) == len(GSM8K_ROWS)
    assert ds[3]["prompt"] == [{"role": "user", "content": "Question 3: what is 3 + 3?"}]
    assert ds[3]["answer"] == "6"
    assert ds[-1]["answer"] == "1234"
    assert set(ds.column_names) == {"prompt", "answer"}


def test_system_prompt_and_instruction(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 1+1?", "answer": 2, "source": "x"}])
    ds = load_dataset_file(path, system_prompt="Be brief.", instruction=ANSWER_INSTRUCTION)
    assert ds[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is 1+1? {ANSWER_INSTRUCTION}"},
    ]
    assert ds[0]["answer"] == "2"
    assert ds[0]["source"] == "x"  # other columns are kept for the reward functions


def test_conversational_prompts_kept(tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2+2?"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": messages, "answer": "4"}])
    ds = load_dataset_file(path, system_prompt="ignored: there is one")
    assert ds[0]["prompt"] == messages


def test_csv_and_parquet(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["What is 2+3?", "What is 7-1?"], "answer": [5, 6]})
    csv_path = tmp_path / "d.csv"
    frame.to_csv(csv_path, index=False)
    parquet_path = tmp_path / "d.parquet"
    frame.to_parquet(parquet_path)
    for path in (csv_path, parquet_path):
        ds = load_dataset_file(path)
        assert ds["answer"] == ["5", "6"]
        assert ds[1]["prompt"] == [{"role": "user", "content": "What is 7-1?"}]


def test_missing_prompt_column_names_file_and_column(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError) as info:
        load_dataset_file(path)
    message = str(info.value)
    assert "gsm.jsonl" in message and "'prompt'" in message and "'question'" in message
    with pytest.raises(ValueError, match="'solution'"):
        load_dataset_file(path, prompt_column="question", answer_column="solution")
    assert "answer" not in load_dataset_file(path, prompt_column="question", answer_column=None).column_names


@pytest.mark.parametrize("name, content", [("e.jsonl", ""), ("e.csv", ""), ("h.csv", "prompt,answer\n")])
def test_empty_files(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=name):
        load_dataset_file(path)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_dataset_file(tmp_path / "nope.jsonl")
    txt = tmp_path / "data.txt"
    txt.write_text("hello")
    with pytest.raises(ValueError, match="unsupported"):
        load_dataset_file(txt)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "", "answer": "1"}])
    with pytest.raises(ValueError, match="row 0"):
        load_dataset_file(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": 1}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl"):
        load_dataset_file(broken)


def test_file_task(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    for name in (f"file:{path}", str(path)):
        task = get_task(name, seed=1, n_eval=5, prompt_column="question")
        assert (len(task.train_dataset), len(task.eval_dataset)) == (16, 5)
        assert task.reward_funcs == [correctness, format_reward]
        assert task.accuracy_reward == "correctness"
        train = {p[-1]["content"] for p in task.train_dataset["prompt"]}
        held = {p[-1]["content"] for p in task.eval_dataset["prompt"]}
        assert not train & held
        assert all(text.endswith(ANSWER_INSTRUCTION) for text in train)
    again = get_task(f"file:{path}", seed=1, n_eval=5, prompt_column="question")
    assert again.eval_dataset.to_list() == task.eval_dataset.to_list()
    with pytest.raises(ValueError, match="n_eval"):
        get_task(f"file:{path}", n_eval=21, prompt_column="question")


def test_file_task_eval_file_and_duplicates(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    eval_path = write_jsonl(tmp_path / "test.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(8, 14)])
    task = get_task(f"file:{train_path}", n_eval=100, eval_file=eval_path, instruction=None)
    assert len(task.eval_dataset) == 6
    assert len(task.train_dataset) == 8  # q8 and q9 are held out, so they leave the training set
    assert task.metadata["dropped_duplicates"] == 2


# -- rows that name image files (vision-language models) -------------------------------------------------------------
def _pictures(folder):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for name, colour in (("red.png", "red"), ("blue.png", "blue")):
        Image.new("RGB", (12, 10), colour).save(folder / name)
    (folder / "notes.png").write_text("not a picture")
    return folder


def test_image_paths_are_read_relative_to_the_data_file(tmp_path):
    import csv

    from datasets import Dataset
    from datasets import Image as ImageFeature

    from grpokit.vision import row_images

    data = tmp_path / "data"
    _pictures(data / "pics")
    write_jsonl(data / "one.jsonl", [{"prompt": "How many?", "image": "pics/red.png", "answer": "1"},
                                     {"prompt": "How many?", "image": None, "answer": "0"}])
    write_jsonl(data / "many.jsonl", [{"prompt": "Both?", "images": ["pics/red.png", "pics/blue.png"], "answer": "2"}])
    with (data / "many.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["prompt", "images", "answer"], ["Both?", '["pics/red.png", "pics/blue.png"]', "2"],
                     ["One?", "pics/blue.png", "1"]])
    red, blue = str((data / "pics" / "red.png").resolve()), str((data / "pics" / "blue.png").resolve())
    records = [{"bytes": None, "path": "pics/red.png"}, {"bytes": None, "path": "pics/blue.png"}]  # paths only
    Dataset.from_dict({"prompt": ["Red?", "Blue?"], "image": records, "answer": ["1", "1"]}).to_parquet(data / "one.parquet")
    Dataset.from_dict({"prompt": ["Red?", "Blue?"], "image": [red, blue], "answer": ["1", "1"]}) \
        .cast_column("image", ImageFeature()).to_parquet(data / "embedded.parquet")  # the pictures inside the file
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkey_cwd = __import__("os").getcwd()
    try:
        __import__("os").chdir(elsewhere)  # relative to the file, not to the working directory
        one = load_dataset_file(data / "one.jsonl")
        many = load_dataset_file(data / "many.jsonl")
        table = load_dataset_file(data / "many.csv")
        parquet = load_dataset_file(data / "one.parquet")
        embedded = load_dataset_file(data / "embedded.parquet")
    finally:
        __import__("os").chdir(monkey_cwd)
    assert one["image"] == [red, None] and many["images"] == [[red, blue]]
    assert table["images"] == [[red, blue], [blue]]
    assert parquet[0]["image"]["path"] == red and parquet[1]["image"]["path"] == blue
    images = row_images(parquet[1]) + row_images(table[0]) + row_images(embedded[1])
    assert [tuple(im.convert("RGB").getpixel((0, 0))) for im in images] == [(0, 0, 255), (255, 0, 0), (0, 0, 255),
                                                                              (0, 0, 255)]
    assert row_images(one[1]) == []


def test_missing_and_unreadable_image_files_name_the_row(tmp_path):
    _pictures(tmp_path / "pics")
    rows = [{"prompt": "a", "image": "pics/red.png", "answer": "1"}, {"prompt": "b", "image": "pics/gone.png",
                                                                        "answer": "1"}]
    with pytest.raises(ValueError) as e:
        load_dataset_file(write_jsonl(tmp_path / "gone.jsonl", rows))
    assert "gone.jsonl: row 1: image file 'pics/gone.png' not found" in str(e.value) and "\n" not in str(e.value)
    rows[1]["image"] = "pics/notes.png"
    with pytest.raises(ValueError, match="row 1: image file 'pics/notes.png' is not an image PIL can read"):
        load_dataset_file(write_jsonl(tmp_path / "notes.jsonl", rows))
    rows[1] = {"prompt": "b", "images": ["pics/red.png", "https://x.org/a.png"], "answer": "1"}
    rows[0] = {"prompt": "a", "images": [], "answer": "1"}
    with pytest.raises(ValueError, match="row 1: images 'https://x.org/a.png' is a URL"):
        load_dataset_file(write_jsonl(tmp_path / "url.jsonl", rows))


def test_a_held_out_picture_is_never_trained_on_but_the_same_question_is(tmp_path):
    from PIL import Image

    pics = tmp_path / "pics"
    pics.mkdir()
    rows = []
    for i in range(12):
        Image.new("RGB", (4, 4), (i * 20, 0, 0)).save(pics / f"{i}.png")
        rows.append({"prompt": "How many red shapes?", "image": f"pics/{i % 10}.png", "answer": str(i % 3)})
    task = get_task(str(write_jsonl(tmp_path / "same.jsonl", rows)), n_eval=4, seed=0)
    held = set(task.eval_dataset["image"])
    assert len(task.eval_dataset) == 4 and not held & set(task.train_dataset["image"])
    assert len(task.train_dataset) + len(task.eval_dataset) + task.metadata["dropped_duplicates"] == 12
