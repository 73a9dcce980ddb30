"""Two pieces of work the CPU path does once instead of many times, each timed on and off in alternated repeats on
SmolLM2-135M (float32), the arithmetic task's prompts through the chat template:

* ``training``: the loss's forward and backward with the system turn all prompts begin with encoded once for the
  batch (``grpokit.forward.logprobs``; on only where it saves >= 10% of the positions, ``PREFIX_MIN_SAVED``) against once
  per group — random completions of a fixed length, every position valid.
* ``reserved``: the decode loop's KV cache with room reserved for the new tokens
  (``grpokit.rollout.reserved_cache``) against transformers' ``DynamicLayer`` (``torch.cat`` per step), sampling
  to a fixed length; the completions are checked equal.

    python benchmarks/bench_shared_work.py training --prompts 8 --group 4 --tokens 12 --lora   # the demo's batch
    python benchmarks/bench_shared_work.py training --prompts 2 --group 4 --tokens 48          # bench_step's
    python benchmarks/bench_shared_work.py reserved --prompts 2 --group 4 --tokens 512 --repeats 2

Prints one line; RESULTS.md holds what was measured with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["training", "reserved"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--lora", action="store_true", help="LoRA r16/α32 on every linear layer (training only)")
    ap.add_argument("--repeats", type=int, default=6, help="timed repeats per side, after one warm-up round")
    args = ap.parse_args()
    from grpokit.models import load_model, load_tokenizer
    from grpokit.tasks import get_task

    model = load_model("smollm2-135m-instruct", dtype="float32")
    tok = load_tokenizer("smollm2-135m-instruct")
    rows = list(get_task("arithmetic", seed=0).train_dataset)[:args.prompts]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in rows for _ in range(args.group)]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    times: dict[str, list[float]] = {"on": [], "off": []}
    if args.what == "training":
        import grpokit.forward.logprobs as logprobs

        if args.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
        model.train()
        completions = torch.randint(100, 40000, (enc.input_ids.shape[0], args.tokens),
                                    generator=torch.Generator().manual_seed(0))
        switch, name = logprobs._prefix_pays, "_prefix_pays"

        def run(side):
            setattr(logprobs, name, switch if side == "on" else (lambda *a, **k: False))
            model.zero_grad(set_to_none=True)
            lp, _ = logprobs.completion_logps(model, enc.input_ids, enc.attention_mask, completions,
                                              torch.ones_like(completions))
            lp.sum().backward()
            return None
    else:
        import grpokit.rollout.decode as decode_module
        from grpokit.rollout.base import SamplingParams
        from grpokit.rollout.transformers_backend import TransformersRollout

        backend = TransformersRollout(tok)
        params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, extra={"min_new_tokens": args.tokens})
        switch, name = decode_module.reserve, "reserve"

        def run(side):
            setattr(decode_module, name, switch if side == "on" else (lambda cache, extra: 0))
            torch.manual_seed(0)
            return backend.generate(model, enc.input_ids, enc.attention_mask, params).completion_ids

    outputs = {}
    for r in range(args.repeats + 1):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            t0 = time.perf_counter()
            outputs[side] = run(side)
            if r:
                times[side].append(time.perf_counter() - t0)
    on, off = (statistics.median(times[k]) for k in ("on", "off"))
    same = "" if outputs["on"] is None else f", completions equal: {torch.equal(outputs['on'], outputs['off'])}"
    print(f"{args.what}: {args.prompts} prompts x {args.group}, {args.tokens} tokens{' LoRA' if args.lora else ''}: "
          f"off {off:.2f} s, on {on:.2f} s (median of {args.repeats}){same}")


if __name__ == "__main__":
    main()
