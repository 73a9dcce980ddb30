"""GRPO steps on one CUDA GPU, grpokit vs TRL 1.16 side by side: random-init models of real shapes built from
configs (no download), bf16 mixed precision, dapo, beta 0, 16 prompts × G 8 = 128 completions × 256 forced new
tokens, gradient checkpointing on and off. Each (shape, checkpointing, side) runs in its own process; the first
step is warm-up and not counted.

    python benchmarks/bench_gpu.py                      # the full comparison (< 8 minutes on an H200), writes RESULTS.md
    python benchmarks/bench_gpu.py --generation         # also grpokit's generation engines alone (generate, static
                                                        # cache, continuous batching) and the shared-prompt forward
    python benchmarks/bench_gpu.py --tiny --device cpu --no-write   # a seconds-long dry run of every code path

Per step: seconds split into ``generate`` (the engine's generate call) and ``train`` (everything else: scoring,
log-probs, loss, backward, optimizer), completion tokens per second, and the peak
``torch.cuda.max_memory_allocated``. Ratios are grpokit / TRL (tokens/s: higher is better; memory: lower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    # SmolLM2-1.7B-like and Qwen2.5-0.5B-like (the shapes the GPU issue was measured on)
    "llama-2048x24-v49152": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=49152),
    "qwen2-896x24-v151936": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
}
TINY = {"tiny-llama": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)}


def build(shape: dict, device: str, seed: int):
    """A random-init causal LM of the shape and a word-level tokenizer covering its whole vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    v = shape["vocab_size"]
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, v)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    kw = {k: val for k, val in shape.items() if k != "arch"}
    kw.update(tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, max_position_embeddings=2048)
    torch.manual_seed(seed)
    if shape["arch"] == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model.to(device), fast


def child(side: str, shape_name: str, gc: bool, steps: int, device: str, variant: str, tiny: bool) -> dict:
    import torch
    import transformers
    from datasets import Dataset

    shapes = TINY if tiny else SHAPES
    model, tok = build(shapes[shape_name], device, seed=0)
    n_prompts, g, new = (4, 4, 16) if tiny else (16, 8, 256)
    rows = [{"prompt": " ".join(f"w{2 + (i * 7 + j) % 997}" for j in range(64))} for i in range(n_prompts * steps)]
    common = dict(output_dir=f"/tmp/bench_gpu_{side}", per_device_train_batch_size=n_prompts * g, num_generations=g,
                  max_completion_length=new, generation_kwargs={"min_new_tokens": new}, max_steps=steps,
                  learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                  gradient_checkpointing=gc, bf16=device == "cuda", shuffle_dataset=False, disable_tqdm=True,
                  loss_type="dapo", beta=0.0, use_cpu=device == "cpu")
    if side == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpokit import GRPOConfig, GRPOTrainer

        if variant == "static-cache":
            common["cache_implementation"] = "static"
        elif variant == "continuous-batching":
            common["use_transformers_continuous_batching"] = True
        elif variant == "share-prompts":
            import grpokit.forward.logprobs

            grpokit.forward.logprobs.SHARE_PROMPTS_ON = ("cpu", "cuda")

    def reward(completion_ids, **kw):
        return [len(set(c)) / max(1, len(c)) for c in completion_ids]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**common),
                          train_dataset=Dataset.from_list(rows), processing_class=tok)
    spent = {"generate": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync(device)
                spent["generate"] += time.perf_counter() - t0
        return wrapper

    cls = type(model)
    cls.generate = timed(cls.generate)
    if hasattr(cls, "generate_batch"):
        cls.generate_batch = timed(cls.generate_batch)
    records = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            spent["generate"] = 0.0
            sync(device)
            if device == "cuda" and state.global_step == 1:
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            wall = time.perf_counter() - self.t0
            records.append({"wall": wall, "generate": spent["generate"], "train": wall - spent["generate"]})

    trainer.add_callback(Clock())
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {"side": side, "variant": variant, "shape": shape_name, "gc": gc, "steps": records,
            "tokens_per_step": n_prompts * g * new, "peak_gib": peak}


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_child(side, shape, gc, steps, device, variant, tiny) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--shape", shape, "--steps", str(steps),
           "--device", device, "--variant", variant] + (["--gc"] if gc else []) + (["--tiny"] if tiny else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if out.returncode != 0:
        return {"side": side, "variant": variant, "shape": shape, "gc": gc, "error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(res: dict) -> dict:
    steps = res["steps"][1:] or res["steps"]  # the first step is warm-up
    med = {k: statistics.median(s[k] for s in steps) for k in ("wall", "generate", "train")}
    return {**med, "tok_s": res["tokens_per_step"] / med["wall"], "peak_gib": res["peak_gib"]}


def table(results: list[dict]) -> str:
    lines = ["| shape | grad. ckpt | side | s/step (generate + train) | completion tok/s | peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        name = r["side"] + ("" if r["variant"] == "default" else f" ({r['variant']})")
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['gc']} | {name} | failed: {r['error'].strip().splitlines()[-1][:80]} | | |")
            continue
        s = summary(r)
        lines.append(f"| {r['shape']} | {r['gc']} | {name} | {s['wall']:.2f} ({s['generate']:.2f} + {s['train']:.2f}) "
                     f"| {s['tok_s']:.0f} | {s['peak_gib']:.1f} |")
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in results):
        for gc in (False, True):
            ours = next((r for r in results if r["shape"] == shape and r["gc"] == gc and r["side"] == "grpokit"
                         and r["variant"] == "default" and "error" not in r), None)
            trl = next((r for r in results if r["shape"] == shape and r["gc"] == gc and r["side"] == "trl"
                        and "error" not in r), None)
            if ours and trl:
                a, b = summary(ours), summary(trl)
                ratios.append(f"{shape}, gradient checkpointing {gc}: tokens/s {a['tok_s'] / b['tok_s']:.2f}×, train "
                              f"part {b['train'] / a['train']:.2f}×, generate {b['generate'] / a['generate']:.2f}×, "
                              f"peak memory {a['peak_gib'] / b['peak_gib']:.2f}×")
    return "\n".join(lines) + ("\n\ngrpokit / TRL: " + "; ".join(ratios) if ratios else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--shape")
    ap.add_argument("--gc", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches: a dry run of every code path")
    ap.add_argument("--generation", action="store_true",
                    help="also grpokit's static-cache and continuous-batching generation and the shared-prompt forward")
    ap.add_argument("--sides", default="grpokit,trl")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.gc, args.steps, args.device, args.variant, args.tiny)))
        return
    results = []
    shapes = TINY if args.tiny else SHAPES
    for shape in shapes:
        for gc in (False, True):
            runs = [(side, "default") for side in args.sides.split(",")]
            if args.generation and not gc:
                runs += [("grpokit", v) for v in ("static-cache", "continuous-batching", "share-prompts")]
            for side, variant in runs:
                res = run_child(side, shape, gc, args.steps, args.device, variant, args.tiny)
                results.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "error"} | (
                    {"error": res["error"][-500:]} if "error" in res else {})), flush=True)
    text = table(results)
    print(text)
    if not args.no_write:
        sys.path.insert(0, HERE)
        from _common import write_section

        write_section("GRPO step on one CUDA GPU", "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()
