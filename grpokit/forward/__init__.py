"""The model's forward pass for training, and what it needs to know about the model:

- :mod:`.logprobs`: per-token log-probs and entropies of completions (the lean path through the hidden states and
  the head, or the plain path through the logits);
- :mod:`.chunked_head`: the head's projection and log-softmax in blocks, never all logits at once;
- :mod:`.prefix`: prompts encoded once per group (and the prefix all prompts share once per call);
- :mod:`.fused_lora` and :mod:`.lora_layers`: a LoRA layer as one autograd operation;
- :mod:`.sharding`: what sharded weights (FSDP / ZeRO-3) change.
"""
