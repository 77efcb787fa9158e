"""Fault injection for tests and the reliability bench: make chosen engine steps fail, or corrupt a request's state.

A ``FaultInjector`` set as ``ModelRunner.fault_injector`` (None, the default, costs nothing) is asked about every
step the runner launches (numbered from 0 in launch order):

* ``launch``: the launch raises (inside ``ModelRunner.execute``, after the step's copies, where a kernel or
  dispatch error would surface), so no device work of the step is queued;
* ``result``: reading the step's sampled tokens raises (``StepHandle.result``), after the step ran;
* ``nan``: before the step, the live KDA state of the named requests is filled with NaN (test mode only: it uses
  the runner's poison executable), so their forward, cache writes and logits turn non-finite inside a real step;
* ``detokenize``: the next detokenisation of the named requests raises (``LLMEngine`` output processing).

``fired`` records what actually happened, so a test can compare the failed requests with the ones it meant.
``RandomFaults`` draws the faults from a seeded generator (the reliability bench).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Mapping

FAULT_KINDS = ("launch", "result", "nan", "detokenize")


class InjectedFault(RuntimeError):
    """The error a ``FaultInjector`` raises."""


@dataclasses.dataclass
class FaultInjector:
    """Faults by step number (``launch``, ``result``, ``nan``) and by request id (``nan``, ``detokenize``)."""

    launch: Collection[int] = ()
    result: Collection[int] = ()
    nan: Mapping[int, Collection[str]] = dataclasses.field(default_factory=dict)
    detokenize: Collection[str] = ()
    fired: list[tuple[str, int | None, tuple[str, ...]]] = dataclasses.field(default_factory=list)

    def on_launch(self, step: int, request_ids: list[str]) -> None:
        if step in self.launch:
            self.fired.append(("launch", step, tuple(request_ids)))
            raise InjectedFault(f"injected launch fault in step {step}")

    def on_result(self, step: int, request_ids: list[str]) -> None:
        if step in self.result:
            self.fired.append(("result", step, tuple(request_ids)))
            raise InjectedFault(f"injected result fault in step {step}")

    def nan_targets(self, step: int, candidates: list[str]) -> list[str]:
        """Of the step's requests whose live state the step reads (``candidates``), those to poison with NaN."""
        chosen = [r for r in candidates if r in set(self.nan.get(step, ()))]
        if chosen:
            self.fired.append(("nan", step, tuple(chosen)))
        return chosen

    def on_detokenize(self, request_id: str) -> None:
        if request_id in self.detokenize:
            self.detokenize = set(self.detokenize) - {request_id}
            self.fired.append(("detokenize", None, (request_id,)))
            raise InjectedFault(f"injected detokenizer fault for {request_id}")


class RandomFaults(FaultInjector):
    """Each step gets a fault with probability ``rate``, of a kind drawn from ``kinds``; a ``nan`` fault hits one
    of the step's requests, a ``detokenize`` fault the next detokenisation of one of them."""

    def __init__(self, seed: int, rate: float, kinds: Collection[str] = FAULT_KINDS):
        super().__init__()
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown or not kinds:
            raise ValueError(f"kinds must be a non-empty subset of {FAULT_KINDS}, got {sorted(kinds)}")
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must lie in [0, 1], got {rate}")
        self._rng = random.Random(seed)
        self._rate = rate
        self._kinds = sorted(kinds)
        self._planned: dict[int, str] = {}

    def _kind(self, step: int) -> str | None:
        if step not in self._planned:
            self._planned[step] = self._rng.choice(self._kinds) if self._rng.random() < self._rate else ""
        return self._planned[step] or None

    def on_launch(self, step: int, request_ids: list[str]) -> None:
        kind = self._kind(step)
        if kind == "detokenize" and request_ids:
            self.detokenize = {*self.detokenize, self._rng.choice(request_ids)}
        if kind == "launch":
            self.launch = {step}
        super().on_launch(step, request_ids)

    def on_result(self, step: int, request_ids: list[str]) -> None:
        if self._kind(step) == "result":
            self.result = {step}
        super().on_result(step, request_ids)

    def nan_targets(self, step: int, candidates: list[str]) -> list[str]:
        if self._kind(step) == "nan" and candidates:
            self.nan = {step: [self._rng.choice(candidates)]}
        return super().nan_targets(step, candidates)
