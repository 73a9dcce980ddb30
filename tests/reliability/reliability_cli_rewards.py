"""A slow reward for the command-line interruption test (imported by the child process as
``reliability_cli_rewards:correctness``): each call sleeps so that a signal lands in the middle of training."""

import time

from grpokit.rewards import correctness as _correctness


def correctness(completions, **kw):
    time.sleep(0.25)
    return _correctness(completions=completions, **kw)
