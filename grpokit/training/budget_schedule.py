"""A learning-rate schedule that runs on a time budget's clock as well as on the step counter
(``lr_schedule_clock: budget``, a job key; the demo's).

A schedule is written for ``max_steps`` steps: the demo's warms up over 10, holds, then falls to 0 at step 130. A run
stopped by its time budget before step 130 — every run on a CPU slower than the one the recipe was tuned on — ends
part way down it, at a learning rate where the held-out accuracy still wanders by several points from one
evaluation to the next (docs/demo.md, "The recipe"). Here the schedule after the warmup advances by whichever is
further along: the steps done (of ``max_steps``) or the training time spent (of the budget), so a slow CPU gets the
same schedule compressed into the steps that fit — the whole decay, ending at 0 — and a CPU fast enough to reach
``max_steps`` inside the budget gets exactly the schedule by steps. Linear decay to the end of a *time* budget is
the "budget-aware" schedule of Li, Yumer and Ramanan, *Budgeted Training: Rethinking Deep Neural Network Training
Under Resource Constraints* (ICLR 2020); the warmup stays counted in steps, since what it protects against (a few
large first updates collapsing the policy onto one answer) is a matter of steps, not seconds.
"""

from __future__ import annotations

from collections.abc import Callable


def budget_schedule_step(step: float, clock_from: int, max_steps: int, time_fraction: float) -> float:
    """The step at which a schedule written for ``max_steps`` steps is evaluated at optimizer step ``step`` when it
    also runs on a time budget whose clock starts at step ``clock_from``::

        s' = s                                         for s < C
        s' = min(S, C + max(s − C, (S − C) · f))       otherwise

    with ``C`` = ``clock_from`` (the warmup's last step ``W``; a run resumed later, with a budget of its own, its first
    step), ``S`` = ``max_steps`` and ``f`` ∈ [0, 1] the share of the budget's time after ``C`` spent (clipped). So
    ``s' ≥ s``: the schedule is never behind the step counter, and reaches its end ``S`` when the budget runs out,
    whichever comes first."""
    if step < clock_from or max_steps <= clock_from:
        return step
    f = min(1.0, max(0.0, time_fraction))
    return min(float(max_steps), clock_from + max(step - clock_from, (max_steps - clock_from) * f))


def run_on_budget_clock(scheduler, clock_from: int, max_steps: int, time_fraction: Callable[[], float]) -> None:
    """Make ``scheduler`` (a ``LambdaLR``: what transformers' ``get_scheduler`` builds for every schedule type but
    ``reduce_lr_on_plateau``) evaluate its schedule at :func:`budget_schedule_step` of each step, with
    ``time_fraction()`` read when the scheduler steps. Its state (``last_epoch``) is unchanged, so a checkpoint saves
    and resumes it as before. A scheduler without per-group lambdas is refused in one line."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not isinstance(lambdas, list) or not all(callable(f) for f in lambdas):
        raise ValueError(f"lr_schedule_clock='budget' is not allowed with a {type(scheduler).__name__} learning-rate "
                         "scheduler: it needs one whose rate is a function of the step (every lr_scheduler_type but "
                         "reduce_lr_on_plateau), or lr_schedule_clock='steps'")

    def on_budget(schedule):
        def rate(step):
            return schedule(budget_schedule_step(step, clock_from, max_steps, time_fraction()))
        return rate

    scheduler.lr_lambdas = [on_budget(f) for f in lambdas]
