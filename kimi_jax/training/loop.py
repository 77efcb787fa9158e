"""The training loop shared by ``train_tiny`` and ``train_chat``: steps under a warmup + cosine schedule, an
optional time budget that fixes the step count from the first steps' speed, logging and a loss history."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from kimi_jax.training.balance import load_summary
from kimi_jax.training.trainer import Schedule, Trainer

PROBE_STEPS = 8  # steps timed before a time budget fixes the total (must not exceed the warmup)


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """steps run; history: logged ``{step, loss, grad_norm, lr, worst_max_over_mean}`` (the last: expert load of
    the steps since the previous entry); step_times: seconds per step; train_seconds: wall time of the loop."""

    steps: int
    history: list[dict]
    step_times: list[float]
    train_seconds: float

    @property
    def median_step_ms(self) -> float:
        return float(np.median(self.step_times[2:] or self.step_times)) * 1e3


def run(trainer: Trainer, batches: Callable[[int], tuple[np.ndarray, np.ndarray | None]], *, lr: float,
        warmup: int, min_lr_ratio: float, steps: int | None, time_budget: float | None, tokens_per_step: int,
        log_every: int, log: Callable[[str], None]) -> LoopResult:
    """Train for ``steps`` (an upper bound with ``time_budget`` seconds); ``batches(step) -> (tokens, weights)``."""
    if steps is None and time_budget is None:
        raise ValueError("steps: give steps, time_budget or both")
    if time_budget is not None and warmup < PROBE_STEPS:
        raise ValueError(f"warmup: a time budget needs warmup >= {PROBE_STEPS}")
    total = steps if steps is not None else 10**9
    schedule = Schedule(lr, warmup, total, min_lr_ratio)
    history, step_times, window_load = [], [], None
    t_train = time.time()
    step = 0
    while step < schedule.total:
        t0 = time.time()
        tokens, weights = batches(step)
        loss, grad_norm, load = trainer.step(tokens, schedule(step), weights)
        loss = float(loss)  # waits for the step
        step_times.append(time.time() - t0)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        load = np.asarray(load)
        window_load = load if window_load is None else window_load + load
        step += 1
        if time_budget is not None and step == PROBE_STEPS:
            per_step = float(np.median(step_times[2:]))
            left = time_budget - (time.time() - t_train)
            planned = PROBE_STEPS + max(0, int(left / per_step))
            schedule = Schedule(lr, warmup, min(total, max(planned, warmup + 1)), min_lr_ratio)
            log(f"time budget {time_budget:.0f}s at {per_step * 1e3:.0f} ms/step -> {schedule.total} steps")
        if step == 1 or step % log_every == 0 or step == schedule.total:
            balance = load_summary(window_load)["worst_max_over_mean"] if window_load.size else None
            window_load = None
            history.append({"step": step, "loss": loss, "grad_norm": float(grad_norm), "lr": schedule(step - 1),
                            "worst_max_over_mean": balance})
            recent = np.median(step_times[-log_every:])
            experts = "" if balance is None else f" experts max/mean {balance:.2f}"
            log(f"step {step:5d}/{schedule.total} loss {loss:.4f} gnorm {float(grad_norm):.3f} "
                f"lr {schedule(step - 1):.2e} {recent * 1e3:.0f} ms/step {tokens_per_step / recent:,.0f} tok/s"
                + experts)
    return LoopResult(step, history, step_times, time.time() - t_train)
