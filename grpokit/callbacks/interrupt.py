"""A clean stop on SIGINT / SIGTERM: finish the step, save a checkpoint, stop."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from transformers import TrainerCallback

from ..bounds.process_group import any_process

logger = logging.getLogger("grpokit")


class GracefulInterrupt(TrainerCallback):
    """First SIGINT/SIGTERM: finish the optimizer step in progress, save a checkpoint, stop training (``train()``
    returns normally; ``trainer.interrupted`` holds the signal number, ``trainer.interrupt_checkpoint`` the path).
    Second signal: stop at once. Handlers are installed only while ``train()`` runs, from the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer):
        self.trainer = trainer
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    # installed around Trainer.train by GRPOTrainer.train
    def install(self) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            if sig == signal.SIGTERM and getattr(self.trainer.args, "enable_jit_checkpoint", False):
                continue  # transformers' own SIGTERM checkpointing was asked for
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored by whoever started us (e.g. nohup): keep it so
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # second signal: stop now
            self.uninstall()
            signal.raise_signal(signum)
            if signum == signal.SIGINT:  # a SIGINT handler that does not raise: make sure we stop
                raise KeyboardInterrupt
            return
        self.received = signum
        name = signal.Signals(signum).name
        logger.warning("grpokit: %s received: finishing the current step, saving a checkpoint and stopping "
                       "(send it again to stop at once)", name)

    def on_step_end(self, args, state, control, **kw):
        # every process must stop at the same step, whichever received the signal
        stop = any_process(self.received is not None, self.trainer.accelerator.device)
        if stop and self.received is None:
            self.received = signal.SIGTERM
        if stop:
            control.should_save = True
            control.should_log = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kw):
        if self.received is not None:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            self.trainer.interrupt_checkpoint = os.path.join(args.output_dir,
                                                             f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        return control
