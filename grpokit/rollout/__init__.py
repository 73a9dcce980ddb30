"""Generation engines behind one small interface (:class:`RolloutBackend`): transformers ``generate`` (default, with
grpokit's CPU decode loop), continuous batching and vLLM. The path from dataset rows to scored completions is the
rollout pipeline's (``grpokit.pipeline``).

The names below load on first use: vLLM imports ``grpokit.rollout.vllm_worker`` into its own processes, in an
environment of its own that need not hold what the trainer's backends import."""

_EXPORTS = {"Generation": ".base", "RolloutBackend": ".base", "SamplingParams": ".base",
            "completion_mask_from_eos": ".base", "TransformersRollout": ".transformers_backend"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'grpokit.rollout' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
