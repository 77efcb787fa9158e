"""DraftGate: a request's drafting pauses after a window of verification steps whose mean acceptance length is
under the floor, for a pause that doubles while windows keep failing and resets when one passes."""

from __future__ import annotations

import pytest

from serve.engine.draft_gate import FIRST_PAUSE, MAX_PAUSE, WINDOW, DraftGate
from serve.engine.spec_config import SpeculativeConfig


def paused_steps(gate: DraftGate) -> int:
    """Steps until the gate drafts again (it then has drafted in one)."""
    n = 0
    gate.step()
    while not gate.drafting:
        n += 1
        gate.step()
    return n


def test_a_failing_window_pauses_and_pauses_double_until_a_window_passes():
    gate = DraftGate(1.5)
    for _ in range(WINDOW - 1):
        gate.record(0)
        gate.step()
        assert gate.drafting  # a window not yet full never pauses
    gate.record(0)
    assert paused_steps(gate) == FIRST_PAUSE
    for _ in range(WINDOW):
        gate.record(0)
    assert paused_steps(gate) == 2 * FIRST_PAUSE
    for _ in range(WINDOW):  # mean length 2.0 >= 1.5: passes, the next pause is the first one again
        gate.record(1)
    assert paused_steps(gate) == 0
    for _ in range(WINDOW):
        gate.record(0)
    assert paused_steps(gate) == FIRST_PAUSE


def test_the_floor_is_on_the_mean_and_pauses_are_capped():
    gate = DraftGate(1.5)
    for accepted in [0, 0, 1, 1]:  # lengths 1, 1, 2, 2: mean 1.5, not below the floor
        gate.record(accepted)
    assert paused_steps(gate) == 0
    for accepted in [0, 0, 0, 1]:  # mean 1.25
        gate.record(accepted)
    assert paused_steps(gate) == FIRST_PAUSE
    pauses = []
    for _ in range(10):
        for _ in range(WINDOW):
            gate.record(0)
        pauses.append(paused_steps(gate))
    assert max(pauses) == MAX_PAUSE and pauses[-1] == MAX_PAUSE


def test_min_acceptance_length_defaults_and_validation():
    ngram = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert ngram.acceptance_floor == 1.5
    assert SpeculativeConfig("dspark", 3).acceptance_floor == 0.0
    assert SpeculativeConfig("ngram", 4, min_acceptance_length=0).acceptance_floor == 0.0
    assert SpeculativeConfig("dspark", 3, min_acceptance_length=2.5).acceptance_floor == 2.5
    for bad in (-0.1, 5.5, "1.5", True):
        with pytest.raises(ValueError, match="min_acceptance_length"):
            SpeculativeConfig("ngram", 4, min_acceptance_length=bad)
