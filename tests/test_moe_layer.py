"""The MoE layer through the Pallas grouped GEMMs (interpret mode on CPU) equals its reference path.

Both paths decode the same MXFP4 bytes exactly; the kernel feeds bf16 operands to its dot with fp32
accumulation, so with bf16 activations the tolerance is bf16 rounding of the expert outputs (2e-2 relative).
Both paths route the same way: the router kernels' fp32 logits differ from XLA's only in summation order."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers import ffn
from kimi_jax.layers.ffn import MoEStack, moe, router_counts

BASE = dict(vocab_size=64, hidden_size=64, num_layers=2, layer_types=("kda", "kda"), mlp_types=("dense", "moe"),
            num_experts=16, num_experts_per_token=4, moe_intermediate_size=32, num_shared_experts=1,
            hidden_act="situ")


@pytest.mark.parametrize("variant", ["mxfp4_latent", "bf16"])
@pytest.mark.parametrize("tokens,row_pairs", [(13, 0), (13, 32), (1, 32)])
def test_moe_pallas_equals_reference(variant, tokens, row_pairs, rng, monkeypatch):
    """Experts sorted by expert (``row_pairs=0``) or one row tile per (token, expert) pair (decode path; 13 tokens
    x 4 choices over 16 experts repeat experts). 16 experts: the Pallas path also routes with the router kernels."""
    monkeypatch.setattr(ffn, "ROW_EXPERT_MAX_PAIRS", row_pairs)
    extra = dict(latent_dim=32, latent_norm=True, experts_mxfp4=True) if variant == "mxfp4_latent" else {}
    cfg = ModelConfig(**BASE, **extra)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.bfloat16)  # 13: not a tile multiple
    want = np.asarray(moe(stack, 0, x, cfg, impl="reference"), np.float32)
    got = np.asarray(moe(stack, 0, x, cfg, impl="pallas"), np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("layers,tokens", [(1, 1), (3, 13), (26, 2)])
def test_router_counts_per_layer_from_one_scatter(layers, tokens, rng):
    """Every layer's (token, choice) pairs per expert, counted over the valid rows only, equal a per-layer numpy
    count: repeated experts within a row and across rows add up, masked rows add nothing, and no count leaks into
    a neighbouring layer's row (the flat scatter offsets each layer by E)."""
    num_experts, k = 16, 4
    idx = np.stack([np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
                    for _ in range(layers)]).astype(np.int32)
    idx[:, 0, :2] = num_experts - 1  # the last expert twice in a row: the highest flat index of each layer
    valid = rng.random(tokens) < 0.7
    valid[0] = True
    got = np.asarray(router_counts(jnp.asarray(idx), jnp.asarray(valid), num_experts))
    want = np.stack([np.bincount(idx[l][valid].reshape(-1), minlength=num_experts) for l in range(layers)])
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(got.sum(axis=1), np.full(layers, int(valid.sum()) * k))


@pytest.mark.parametrize("tokens", [1, 3])
def test_shared_expert_fused_into_the_routed_launch(tokens, rng, monkeypatch):
    """FUSE_SHARED_EXPERT (bf16 experts, no latent, per-row decode path): the shared expert runs as one more row
    per token in the routed launches and the layer's output equals the unfused Pallas path and the reference;
    with a latent projection (K3) or MXFP4 experts the flag does not apply."""
    monkeypatch.setattr(ffn, "ROW_EXPERT_MAX_PAIRS", 32)
    cfg = ModelConfig(**BASE)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.bfloat16)
    want = np.asarray(moe(stack, 0, x, cfg, impl="reference"), np.float32)
    unfused = np.asarray(moe(stack, 0, x, cfg, impl="pallas"), np.float32)
    monkeypatch.setattr(ffn, "FUSE_SHARED_EXPERT", True)
    assert ffn._fuses_shared_expert(stack, x, cfg, "pallas")
    fused = np.asarray(moe(stack, 0, x, cfg, impl="pallas"), np.float32)
    assert np.isfinite(fused).all()
    for other in (want, unfused):
        assert np.linalg.norm(fused - other) / np.linalg.norm(other) < 2e-2
    shared_only = np.asarray(ffn.total(ffn._glu_mlp(x, stack.shared_gate, stack.shared_up, stack.shared_down, 0, cfg,
                                                    "reference"), jnp.float32))
    assert np.linalg.norm(fused - (want - shared_only)) > 0.1 * np.linalg.norm(want)  # the shared part is in it
    assert not ffn._fuses_shared_expert(stack, x, cfg, "reference")
    assert not ffn._fuses_shared_expert(stack, jnp.zeros((9, cfg.hidden_size), jnp.bfloat16), cfg, "pallas")  # 36 pairs
    latent = ModelConfig(**BASE, latent_dim=32, latent_norm=True)
    latent_stack = MoEStack(latent, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert not ffn._fuses_shared_expert(latent_stack, x, latent, "pallas")
    packed = ModelConfig(**BASE, experts_mxfp4=True)
    assert not ffn._fuses_shared_expert(MoEStack(packed, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x, packed, "pallas")


WIDE = {**BASE, "hidden_size": 128, "moe_intermediate_size": 128}  # input widths 128: both byte orders fit


@pytest.mark.parametrize("order", ["pairs", "words"])
@pytest.mark.parametrize("tokens,row_pairs", [(13, 0), (1, 32)])
def test_reordered_experts_give_the_checkpoint_order_result(order, tokens, row_pairs, rng, monkeypatch):
    """use_byte_order re-orders the packed expert bytes (w*_packed -> w*_pairs / w*_words); the layer's reference
    and Pallas paths then give what the checkpoint bytes gave (sorted and per-row decode paths); the word order
    records whether its scales are narrow."""
    monkeypatch.setattr(ffn, "ROW_EXPERT_MAX_PAIRS", row_pairs)
    cfg = ModelConfig(**WIDE, experts_mxfp4=True)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.bfloat16)
    want = np.asarray(moe(stack, 0, x, cfg, impl="reference"), np.float32)
    ffn.use_byte_order(stack, order)
    assert not hasattr(stack, "w1_packed") and getattr(stack, f"w2_{order}")[...].shape == (1, 16, 128, 64)
    assert getattr(stack, "narrow_scales", None) is (True if order == "words" else None)
    np.testing.assert_array_equal(np.asarray(moe(stack, 0, x, cfg, impl="reference"), np.float32), want)
    got = np.asarray(moe(stack, 0, x, cfg, impl="pallas"), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    with pytest.raises(ValueError, match="w1/w3/w2_packed"):
        ffn.use_byte_order(stack, order)


@pytest.mark.parametrize("order,width", [("pairs", 64), ("words", 128)])
def test_reordering_goes_layer_by_layer_in_place(order, width, rng):
    """use_byte_order converts each MoE layer of a stack into the same buffer: the result equals the whole-stack
    conversion, layer for layer; a stack whose input widths are not multiples of what the order needs, or an
    unknown order, is refused by name."""
    cfg = ModelConfig(**{**WIDE, "num_layers": 3, "layer_types": ("kda",) * 3, "mlp_types": ("dense", "moe", "moe")},
                      experts_mxfp4=True)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    convert = ffn.REORDERS[order][0]
    want = {name: np.asarray(convert(getattr(stack, f"{name}_packed")[...])) for name in ("w1", "w2")}
    assert ffn.byte_order_fits(stack, order)
    ffn.use_byte_order(stack, order)
    for name, expected in want.items():
        assert expected.shape[0] == 2
        np.testing.assert_array_equal(np.asarray(getattr(stack, f"{name}_{order}")[...]), expected)
    too_narrow = MoEStack(ModelConfig(**{**BASE, "moe_intermediate_size": width // 2}, experts_mxfp4=True),
                          dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert not ffn.byte_order_fits(too_narrow, order) and not ffn.byte_order_fits(None, order)
    with pytest.raises(ValueError, match=f"multiples of {width}"):
        ffn.use_byte_order(too_narrow, order)
    with pytest.raises(ValueError, match="order must be one of"):
        ffn.use_byte_order(too_narrow, "nibbles")


def test_serving_byte_order_prefers_words_then_pairs():
    """"auto" serves the word order when the fast kernels run and every input width is a multiple of 128, pair
    halves when they are multiples of 64 only, and the checkpoint order otherwise (bf16 or converted experts, no
    MoE, or no fast kernels); an explicit order is kept."""
    wide = MoEStack(ModelConfig(**WIDE, experts_mxfp4=True), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    pairs_only = MoEStack(ModelConfig(**{**BASE, "moe_intermediate_size": 64}, experts_mxfp4=True),
                          dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bf16 = MoEStack(ModelConfig(**WIDE), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert ffn.serving_byte_order(wide, "auto", True) == "words"
    assert ffn.serving_byte_order(pairs_only, "auto", True) == "pairs"
    assert ffn.serving_byte_order(wide, "auto", False) == "checkpoint"
    assert ffn.serving_byte_order(bf16, "auto", True) == "checkpoint"
    assert ffn.serving_byte_order(None, "auto", True) == "checkpoint"
    assert ffn.serving_byte_order(pairs_only, "pairs", False) == "pairs"
    ffn.use_byte_order(wide, "words")
    assert ffn.serving_byte_order(wide, "auto", True) == "checkpoint"  # already converted: nothing left to do


def test_wide_scales_are_not_narrow():
    """A scale code above 128 (block scale 2**2) turns the word order's folded decode off."""
    cfg = ModelConfig(**WIDE, experts_mxfp4=True)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    stack.w3_scale[...] = stack.w3_scale[...].at[0, 3, 5, 1].set(129)
    ffn.use_byte_order(stack, "words")
    assert stack.narrow_scales is False


@pytest.mark.parametrize("tokens", [1, 13, 80])  # 80 tokens x 4 choices over 16 experts: prefill-sized tiles
def test_mgpu_layout_experts_give_the_checkpoint_order_result(tokens, rng, monkeypatch):
    """use_mgpu_layout re-lays the experts for the Mosaic-GPU decode kernel (w1_packed / w1_scale -> w1_mgpu /
    w1_mgpu_scale); the reference path then gives exactly what the checkpoint bytes gave, and the Pallas path
    (per-row tiles for one token, rows sorted by expert for more; the kernel in Mosaic-GPU's interpreter) the
    same within bf16."""
    monkeypatch.setattr(ffn, "ROW_EXPERT_MAX_PAIRS", 32)
    cfg = ModelConfig(**{**BASE, "num_layers": 3, "layer_types": ("kda",) * 3, "mlp_types": ("dense", "moe", "moe"),
                         "moe_intermediate_size": 64}, experts_mxfp4=True)  # K = N = 64 everywhere
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.bfloat16)
    want = np.asarray(moe(stack, 1, x, cfg, impl="reference"), np.float32)  # the second MoE layer of the stack
    ffn.use_mgpu_layout(stack)
    assert not hasattr(stack, "w1_packed") and not hasattr(stack, "w1_scale")
    assert stack.w2_mgpu[...].shape == (2, 16, 1, 64, 32) and stack.w2_mgpu_scale[...].shape == (2, 16, 2, 64)
    assert ffn.row_path(tokens, cfg.num_experts_per_token, "pallas") == (tokens == 1)  # per-row or sorted rows
    np.testing.assert_array_equal(np.asarray(moe(stack, 1, x, cfg, impl="reference"), np.float32), want)
    got = np.asarray(moe(stack, 1, x, cfg, impl="pallas"), np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    with pytest.raises(ValueError, match="w1_packed"):
        ffn.use_mgpu_layout(stack)


def test_big_random_parameters_are_drawn_one_matrix_at_a_time(monkeypatch):
    """Stacks above CHUNK_ELEMENTS are drawn per trailing matrix (bounded temporaries: drawing a K3 expert stack
    at once needed 237 GB). Compiled for the CPU backend only, never run (the GPU compiler's temporaries differ:
    this once failed on the H200); skipped where no CPU backend is up (``JAX_PLATFORMS=cuda``)."""
    import jax

    from kimi_jax.layers import common

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip("no CPU backend in this process")

    def temp_bytes(shape):
        fn = jax.jit(lambda k: common.draw_in_chunks(k, shape, lambda kk, s: jax.random.bits(kk, s, jnp.uint8)))
        with jax.default_device(cpu):
            return fn.lower(jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes

    big = (4, 8, 256, 512)
    whole = temp_bytes(big)
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 100)
    assert temp_bytes(big) < whole / 8


def test_random_parameters_drawn_in_chunks_keep_every_code_and_distinct_matrices(monkeypatch):
    """Chunked draws still give every MXFP4 code and distinct matrices; small stacks keep one draw."""
    from kimi_jax.layers import common
    from kimi_jax.layers.ffn import _random_mxfp4

    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 100)
    shape = (2, 3, 16, 64)  # [L, E, out, in]
    packed, scales = _random_mxfp4(nnx.Rngs(0), shape, 0.1)
    p = np.asarray(packed[...])
    assert p.shape == (2, 3, 16, 32) and scales[...].shape == (2, 3, 16, 2)
    assert len(np.unique(np.stack([p & 15, p >> 4]))) == 16
    flat = p.reshape(6, -1)
    assert len({row.tobytes() for row in flat}) == 6  # every expert matrix drawn from its own key
    w = common.normal(nnx.Rngs(1), (4, 8, 32), 0.5, jnp.float32)[...]
    assert w.shape == (4, 8, 32) and 0.35 < float(jnp.std(w)) < 0.65
