"""Speculative-decoding acceptance of a run, from the server's ``/metrics`` counters in vLLM's names.

The load generator scrapes ``/metrics`` before and after the run and reports the difference, so the figures
cover the run's requests only (plus anything else the server served meanwhile). Counters are summed over label
sets (model, engine), so a data-parallel or multi-model server reports one total:

    vllm:spec_decode_num_drafts_total                   verification rows with at least one draft
    vllm:spec_decode_num_draft_tokens_total             drafts proposed
    vllm:spec_decode_num_accepted_tokens_total          drafts accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total  accepted drafts by draft position (label ``position``)
"""

from __future__ import annotations

import dataclasses

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIX = "vllm:spec_decode_"
_TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclasses.dataclass(frozen=True)
class SpecCounters:
    """The speculative-decoding counters of one scrape (totals since the server started)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda v: tuple(v) + (0.0,) * (width - len(v))  # noqa: E731
        return SpecCounters(*(getattr(self, f) - getattr(before, f) for f in _TOTALS),
                            tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))))

    def summary(self) -> dict:
        """Acceptance figures: mean acceptance length (tokens per verification row: 1 + accepted drafts; 1.0 = no
        gain), draft acceptance rate (accepted / proposed) and the acceptance rate at each draft position
        (accepted at position i / rows with drafts)."""
        rows = self.num_drafts
        return {"num_drafts": int(rows), "num_draft_tokens": int(self.num_draft_tokens),
                "num_accepted_tokens": int(self.num_accepted_tokens),
                "mean_acceptance_length": 1.0 + self.num_accepted_tokens / rows if rows else 1.0,
                "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0,
                "acceptance_rate_per_position": [a / rows if rows else 0.0 for a in self.accepted_per_pos]}


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus exposition, or None when the server exports none (it does not speculate)."""
    totals = dict.fromkeys(_TOTALS, 0.0)
    per_pos: dict[int, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(_PREFIX) or not sample.name.endswith("_total"):
                continue
            name = sample.name[len(_PREFIX):-len("_total")]
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
                found = True
            elif name in totals:
                totals[name] += sample.value
                found = True
    if not found:
        return None
    width = max(per_pos, default=-1) + 1
    return SpecCounters(**totals, accepted_per_pos=tuple(per_pos.get(i, 0.0) for i in range(width)))


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str, headers: dict) -> SpecCounters | None:
    """GET ``/metrics`` -> its counters; None when the server has no ``/metrics`` or exports no such counter."""
    try:
        response = await client.get(base_url + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_spec_counters(response.text)


def format_spec_report(spec: dict) -> str:
    """The lines the load generator prints under its table."""
    lines = ["{s:{c}^50}".format(s="Speculative Decoding", c="-")]
    for label, value in (("Drafts (verification rows):", spec["num_drafts"]),
                         ("Draft tokens:", spec["num_draft_tokens"]),
                         ("Accepted tokens:", spec["num_accepted_tokens"]),
                         ("Mean acceptance length:", spec["mean_acceptance_length"]),
                         ("Draft acceptance rate (%):", 100.0 * spec["draft_acceptance_rate"])):
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")
    per_pos = ", ".join(f"{a:.2f}" for a in spec["acceptance_rate_per_position"])
    lines.append(f"{'Acceptance rate per position:':<40}{per_pos}")
    return "\n".join(lines)
