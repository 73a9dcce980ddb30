"""What the learner adds around the loss:

- :mod:`.gradient_guard`: the non-finite gradient guard before an optimizer step;
- :mod:`.lora_plus`: LoRA+ learning rates for the adapter's ``B`` matrices;
- :mod:`.entropy_control`: the entropy bonus and its adaptive controller;
- :mod:`.reference`: a reference policy that moves (TR-DPO's soft update);
- :mod:`.weight_average`: the trained weights' exponential moving average (``ema_decay``);
- :mod:`.metrics`: the trainer's metrics between two log lines.
"""
