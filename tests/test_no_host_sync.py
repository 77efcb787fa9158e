"""The index math around the kernels and in the step layout lowers without ``while`` loops: XLA:GPU runs a
while loop by reading its predicate on the host, which blocks the launch until the device gets there and so
defeats asynchronous scheduling (measured on the H200: a dynamic-trip fori_loop makes the launch return only
when the device is done; conditionals do not). ``jnp.searchsorted``'s default method is such a loop."""

import jax
import jax.numpy as jnp
import pytest

from kimi_jax.step import StepInputs, dense_step, token_layout
from pallas_kernels.kda.chunk import _chunk_plan
from pallas_kernels.mla.attention import plan_tiles
from pallas_kernels.mxfp4.tiles import make_tile_schedule


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("case", ["token_layout", "kda_chunk_plan", "mla_tiles", "moe_tiles"])
def test_no_while_loop(case):
    cu = jnp.asarray([0, 3, 3, 9], jnp.int32)
    if case == "token_layout":
        fields = dense_step(3, 4, block_size=4)
        step = StepInputs(token_ids=jnp.zeros(12, jnp.int32), **{k: jnp.asarray(v) for k, v in fields.items()})
        text = lowered_text(lambda s: token_layout(s).seq_ids, step)
    elif case == "kda_chunk_plan":
        text = lowered_text(lambda c: _chunk_plan(c, 3, 16), cu)
    elif case == "mla_tiles":
        text = lowered_text(lambda c: plan_tiles(c, 8, 4), cu)
    else:
        text = lowered_text(lambda s: make_tile_schedule(s, 64, 16), jnp.asarray([5, 0, 40, 3], jnp.int32))
    assert "while" not in text


def test_default_searchsorted_would_be_caught():
    """The check above can fail: the default method does lower to a while loop."""
    text = lowered_text(lambda a, v: jnp.searchsorted(a, v), jnp.arange(8), jnp.arange(4))
    assert "while" in text
