"""The model tells the MLA op when a step may take the Mosaic-GPU decode kernel: decode-only steps over finite pages
(``decode_q_len=1``); never for prefill or mixed steps, nor when the engine's test mode NaN-poisons free pages."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.model import KimiModel, forward
from kimi_jax.step import StepInputs, dense_step, init_cache
from pallas_kernels import mla as mla_ops
from tests.test_model_incremental import KL

BS = 4


@pytest.fixture(scope="module")
def model():
    return KimiModel(KL, dtype=jnp.float32, rngs=nnx.Rngs(0))


def _step(length: int, context: list[int], decode_only: bool) -> StepInputs:
    fields = dense_step(len(context), length, block_size=BS, context=np.asarray(context), max_len=16)
    tokens = np.arange(len(context) * length, dtype=np.int32) % KL.vocab_size
    return StepInputs(token_ids=jnp.asarray(tokens), decode_only=decode_only,
                      **{k: jnp.asarray(v) for k, v in fields.items()})


@pytest.mark.parametrize("length,decode_only,finite_pages,want", [
    (1, True, True, 1),      # decode step, zero-initialised / finite pages: the Mosaic-GPU kernel may run
    (1, True, False, None),  # test mode: free pages hold NaN, which that kernel would multiply by zero
    (3, False, True, None),  # prefill chunks: the general kernel
])
def test_forward_passes_decode_q_len(model, monkeypatch, length, decode_only, finite_pages, want):
    seen = []
    real = mla_ops.mla_paged_attention
    monkeypatch.setattr(mla_ops, "mla_paged_attention",
                        lambda *a, **k: seen.append(k["decode_q_len"]) or real(*a, **k))
    cache = init_cache(KL, num_blocks=1 + 2 * 4, block_size=BS, num_slots=3, dtype=jnp.float32)
    forward(model, cache, _step(length, [5, 2], decode_only), impl="reference", finite_pages=finite_pages)
    assert seen == [want] * len(KL.mla_layers)
