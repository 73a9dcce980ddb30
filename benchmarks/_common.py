"""Shared helpers of the benchmarks: interleaved timing, a TRL ``_compute_loss`` stand-in, RESULTS.md sections."""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    import trl

    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"transformers {transformers.__version__}, trl {trl.__version__}, python {sys.version.split()[0]}")


def interleaved(fns: dict, rounds: int = 9, min_time: float = 0.05, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round; the functions alternate within every round
    (and the order flips each round) so that machine noise hits them alike. Compare them with :func:`paired`."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    reps = {}
    for name, fn in fns.items():  # calls per measurement so that one lasts ≥ min_time
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        reps[name] = max(1, int(min_time / one))
    samples = defaultdict(list)
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / reps[name])
    return dict(samples)


def paired(samples: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """``(median a, median b, median over rounds of b/a)``: the ratio is taken within each round, where both
    ran back to back, which cancels slow drifts of a shared machine."""
    ratios = [y / x for x, y in zip(samples[a], samples[b])]
    return statistics.median(samples[a]), statistics.median(samples[b]), statistics.median(ratios)


class _Accelerator:
    num_processes, process_index, sync_gradients = 1, 0, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss_fn(loss_type: str, level: str, T: int, epsilon=0.2, epsilon_high=None):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` called unbound on a minimal stand-in for ``self`` whose
    ``_get_per_token_logps_and_entropies`` returns the given log-probs: only TRL's loss math runs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    fake = types.SimpleNamespace()
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    fake.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    fake.loss_type, fake.importance_sampling_level = loss_type, level
    fake.epsilon_low, fake.epsilon_high = epsilon, epsilon_high if epsilon_high is not None else epsilon
    fake.beta, fake.top_entropy_quantile, fake.off_policy_mask_threshold = 0.0, 1.0, None
    fake.use_vllm = fake.vllm_importance_sampling_correction = False
    fake.current_gradient_accumulation_steps, fake.max_completion_length = 1, T
    fake.accelerator, fake.model = _Accelerator(), types.SimpleNamespace(training=True)
    fake.aux_loss_enabled = fake._entropy_bonus_enabled = False
    fake.args = types.SimpleNamespace(
        delta=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1,
    )

    def call(logps, entropies, inputs):
        fake._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
        return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]

    return call


def decode_step_ms(model, rows: int, sides: dict, repeats: int = 15) -> dict[str, float]:
    """Median milliseconds of one decode step of ``model`` (one new token per row after a 52-token prompt; the
    prefill is not timed) under each side's context (``sides``: name -> a function of nothing returning a context
    manager, entered around each step), the sides alternated and their order flipped every round, after a warm-up
    round."""
    from transformers import DynamicCache

    prompt = torch.randint(100, 40000, (rows, 52), generator=torch.Generator().manual_seed(0))
    step = torch.randint(100, 40000, (rows, 1), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(rows, 53, dtype=torch.long)
    positions = torch.full((rows, 1), 52)

    @torch.no_grad()
    def one_step():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        model(input_ids=step, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
              logits_to_keep=1)
        return time.perf_counter() - t0

    names = list(sides)
    samples = {name: [] for name in names}
    for r in range(repeats + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            with sides[name]():
                t = one_step()
            if r:  # the first round warms up
                samples[name].append(t)
    return {name: 1000 * statistics.median(ts) for name, ts in samples.items()}


def write_section(name: str, command: str, body: str) -> None:
    """Replace (or append) the section ``## name`` of RESULTS.md."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmarks: grpokit side by side with TRL 1.16\n\n" \
        "Every number below was produced by the command above its table, on the machine it names; ratios " \
        "come from one run with the two sides interleaved.\n"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = f"## {name}\n\n`{command}`\n\n{machine()}; {when}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")
