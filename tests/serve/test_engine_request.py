"""SamplingParams validation and Request bookkeeping (seeds, logprobs, constraint, outputs)."""

from __future__ import annotations

import numpy as np
import pytest

from serve.engine import MAX_LOGPROBS, Request, RequestStatus, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.1), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", 1.5), ("logprobs", MAX_LOGPROBS + 1), ("constraint_factory", 3), ("n", True),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value}).validate()


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###").validate()
    assert p.stop == ["###"] and p.max_tokens == 16 and p.top_k == 0 and not p.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(top_k=-1).validate().top_k == -1
    assert not SamplingParams().uses_penalties and SamplingParams(repetition_penalty=1.2).uses_penalties


class CountingConstraint:
    def __init__(self):
        self.seen = []

    def allowed_token_bitmask(self):
        return np.full(1, -1, np.int32)

    def advance(self, token_id):
        self.seen.append(token_id)

    def is_terminated(self):
        return len(self.seen) >= 2


def test_request_seed_logprobs_constraint_and_metrics():
    r = Request("a", [1, 2], SamplingParams(seed=-1, logprobs=1, constraint_factory=CountingConstraint,
                                            max_tokens=10), eos_token_ids=[0])
    assert r.seed == (1 << 64) - 1
    assert Request("b", [1], SamplingParams()).seed != Request("c", [1], SamplingParams()).seed
    assert Request("d", [1], SamplingParams(seed=5), seed=9).seed == 9
    r.append_output_token(7, {7: -0.5, 3: -1.0})
    assert not r.check_stop(max_model_len=100)
    r.append_output_token(8, {8: -0.25})
    assert r.check_stop(max_model_len=100) and r.status == RequestStatus.FINISHED_STOPPED
    assert r.constraint.seen == [7, 8] and r.cumulative_logprob == -0.75
    assert r.all_token_ids == [1, 2, 7, 8] and r.output_logprobs == [{7: -0.5, 3: -1.0}, {8: -0.25}]
    m = r.metrics
    assert m.first_token_time is not None and m.first_token_time >= m.arrival_time
    with pytest.raises(ValueError, match="empty"):
        Request("e", [], SamplingParams())
