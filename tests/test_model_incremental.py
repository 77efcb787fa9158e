"""Incremental decoding equals the full forward for every layer kind (fp32, 1e-4 relative).

Two small configs cover every layer kind: Kimi-Linear style (softplus gate, low-rank output gate, GVA value
heads, MLA without q-LoRA, plain residuals, bf16 experts) and K3 style (lower-bound gate, full-rank gate,
q-LoRA + gated MLA whose head widths fit the Pallas absorption kernels, Block AttnRes, Stable LatentMoE with
SiTU and MXFP4 experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.api import KimiLM
from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from kimi_jax.layers import mla as mla_layers
from kimi_jax.step import StepInputs, init_cache
from pallas_kernels.mla import quantize_latent_fp8

KL = ModelConfig(vocab_size=97, hidden_size=32, num_layers=4, layer_types=("kda", "mla", "kda", "kda"),
                 mlp_types=("dense", "moe", "moe", "moe"), kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=16,
                 kda_v_head_dim=8, mla_num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, intermediate_size=48, num_experts=6, num_experts_per_token=2,
                 moe_intermediate_size=16, num_shared_experts=1, routed_scaling_factor=2.0, num_expert_group=2,
                 topk_group=1, eos_token_id=1)
K3 = ModelConfig(vocab_size=101, hidden_size=64, num_layers=5, layer_types=("kda", "mla", "kda", "kda", "mla"),
                 mlp_types=("dense", "moe", "moe", "moe", "moe"), kda_num_heads=2, kda_num_v_heads=2,
                 kda_head_dim=16, kda_v_head_dim=16, kda_gate_lower_bound=-5.0, kda_full_rank_gate=True,
                 mla_num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
                 v_head_dim=16, mla_output_gate=True, hidden_act="situ", intermediate_size=64, num_experts=8,
                 num_experts_per_token=3, moe_intermediate_size=32, num_shared_experts=2, latent_dim=32,
                 latent_norm=True, experts_mxfp4=True, attn_res_block_size=2, eos_token_id=1)
BS = 4  # small pages so sequences span several blocks


T_PAD, N_PAD, M_PAD, P_PAD = 32, 4, 32, 8  # every step in this file has one shape: one compile per model


def make_step(seqs, context, *, tables, slots, rows=None, ck_pos=None, ck_slots=None):
    """A StepInputs padded to the file's fixed shape; returns (step, number of real logits rows)."""
    lens = np.array([len(s) for s in seqs], np.int32)
    n, total = len(seqs), int(lens.sum())
    cu = np.concatenate([[0], np.cumsum(lens), np.full(N_PAD - n, total)]).astype(np.int32)
    rows = np.arange(total, dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
    ck_pos = np.full((n, 2), -1, np.int32) if ck_pos is None else np.asarray(ck_pos, np.int32)
    ck_slots = np.zeros(ck_pos.shape, np.int32) if ck_slots is None else np.asarray(ck_slots, np.int32)
    table = np.zeros((N_PAD, P_PAD), np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    pad = lambda a, value=0: np.pad(a, [(0, N_PAD - n)] + [(0, 0)] * (a.ndim - 1), constant_values=value)
    step = StepInputs(
        token_ids=jnp.asarray(np.pad(np.concatenate([np.asarray(s, np.int32) for s in seqs]), (0, T_PAD - total))),
        cu_seqlens=jnp.asarray(cu), context_lens=jnp.asarray(pad(np.asarray(context, np.int32))),
        block_tables=jnp.asarray(table), state_slots=jnp.asarray(pad(np.asarray(slots, np.int32))),
        logits_indices=jnp.asarray(np.pad(rows, (0, M_PAD - rows.size))),
        checkpoint_positions=jnp.asarray(pad(ck_pos, -1)), checkpoint_slots=jnp.asarray(pad(ck_slots)))
    return step, rows.size


def run(lm, cache, step_and_rows):
    """lm.step on a padded step, keeping only the real logits rows."""
    step, rows = step_and_rows
    logits, cache = lm.step(cache, step)
    return np.asarray(logits)[:rows], cache


def new_cache(lm, num_blocks=32, num_slots=8):
    from kimi_jax.step import init_cache
    return init_cache(lm.config, num_blocks=num_blocks, block_size=BS, num_slots=num_slots, dtype=jnp.float32)


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def lm(request):
    cfg = KL if request.param == "kimi_linear" else K3
    return KimiLM(KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3)))


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 dots at full precision on every backend: on the GPU, JAX's default (TF32, a 10-bit mantissa) alone
    puts two orders of the same math 6e-4 apart (the unabsorbed MLA prefill against the absorbed, H200)."""
    with jax.default_matmul_precision("highest"):
        yield


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_chunked_prefill_and_decode_match_full_forward(lm, rng):
    ids = rng.integers(0, lm.config.vocab_size, 19).tolist()
    table = [list(range(1, 7))]
    full, _ = run(lm, new_cache(lm), make_step([ids], [0], tables=table, slots=[1]))
    cache = new_cache(lm)
    pieces, done, got = [6, 5, 1, 1, 3, 1, 1, 1], 0, []
    for size in pieces:
        chunk = ids[done:done + size]
        logits, cache = run(lm, cache, make_step([chunk], [done], tables=table, slots=[1]))
        got.append(np.asarray(logits))
        done += size
    assert done == len(ids)
    assert rel(np.concatenate(got), full) < 1e-4


def test_packed_sequences_do_not_interact(lm, rng):
    a = rng.integers(0, lm.config.vocab_size, 11).tolist()
    b = rng.integers(0, lm.config.vocab_size, 3).tolist()
    c = rng.integers(0, lm.config.vocab_size, 6).tolist()
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    packed, _ = run(lm, new_cache(lm), make_step([a, b, c], [0, 0, 0], tables=tables, slots=[1, 2, 3]))
    alone = []
    for s, t in zip([a, b, c], tables):
        out, _ = run(lm, new_cache(lm), make_step([s], [0], tables=[t], slots=[1]))
        alone.append(np.asarray(out))
    assert rel(packed, np.concatenate(alone)) < 1e-4


def test_padding_rows_and_empty_sequences_are_inert(lm, rng):
    """Garbage in padding rows / empty sequences (pointing at scratch block 0 and slot 0) changes nothing."""
    a = rng.integers(0, lm.config.vocab_size, 7).tolist()
    ref, _ = run(lm, new_cache(lm), make_step([a], [0], tables=[[1, 2]], slots=[1]))
    step, rows = make_step([a, []], [0, 0], tables=[[1, 2], [0, 0]], slots=[1, 0])
    noisy = StepInputs(**{**step.__dict__, "token_ids": step.token_ids.at[7:].set(3)})
    out, _ = run(lm, new_cache(lm), (noisy, rows))
    assert rel(out, ref) < 1e-5


def test_checkpoint_resume_equals_recompute(lm, rng):
    ids = rng.integers(0, lm.config.vocab_size, 13).tolist()
    table = [[1, 2, 3, 4]]
    full, cache = run(lm, new_cache(lm), make_step([ids], [0], tables=table, slots=[1],
                                                   ck_pos=[[5, 9]], ck_slots=[[4, 5]]))
    for pos, slot in ((5, 4), (9, 5)):
        resumed, _ = run(lm, cache, make_step([ids[pos:]], [pos], tables=table, slots=[slot]))
        assert rel(resumed, np.asarray(full)[pos:]) < 1e-4
        full, cache = run(lm, new_cache(lm), make_step([ids], [0], tables=table, slots=[1],
                                                       ck_pos=[[5, 9]], ck_slots=[[4, 5]]))


def test_generate_matches_argmax_of_full_forward(lm, rng):
    prompt = rng.integers(2, lm.config.vocab_size, 5).tolist()
    out = lm.generate([prompt], max_new_tokens=4, stop_token_ids=[])[0]
    logits = np.asarray(lm.logits(np.asarray([out[:-1]])))[0]
    assert out[5:] == np.argmax(logits[4:], axis=-1).tolist()


def test_unabsorbed_mla_form_matches_absorbed(lm, rng):
    """The MHA ("un-absorbed") prefill form and the absorbed form are the same function, chunked or not."""
    other = KimiLM(lm.model, mla_form="unabsorbed")
    ids = rng.integers(0, lm.config.vocab_size, 12).tolist()
    table = [[1, 2, 3, 4]]
    want, cache_a = run(lm, new_cache(lm), make_step([ids[:7]], [0], tables=table, slots=[1]))
    got, cache_u = run(other, new_cache(lm), make_step([ids[:7]], [0], tables=table, slots=[1]))
    assert rel(got, want) < 1e-4
    want, _ = run(lm, cache_a, make_step([ids[7:]], [7], tables=table, slots=[1]))
    got, _ = run(other, cache_u, make_step([ids[7:]], [7], tables=table, slots=[1]))
    assert rel(got, want) < 1e-4


def test_pallas_unabsorbed_prefill_matches_reference(lm, rng):
    """The engine's prefill form with the Pallas kernels (interpret mode: the MLA prefill flash kernel over the
    gathered latents, a padding sequence in the step): one sequence continuing over its cached context, one new,
    equals the reference ops in the absorbed form, both chunks and the caches they leave."""
    pallas = KimiLM(lm.model, impl="pallas", mla_form="unabsorbed")
    a, b = (rng.integers(0, lm.config.vocab_size, n).tolist() for n in (12, 6))
    tables = [[1, 2, 3, 4], [5, 6]]
    first = make_step([a[:7]], [0], tables=tables[:1], slots=[1])
    want, cache_ref = run(lm, new_cache(lm), first)
    got, cache_pallas = run(pallas, new_cache(lm), first)
    assert rel(got, want) < 1e-4
    second = make_step([a[7:], b], [7, 0], tables=tables, slots=[1, 2])
    want, cache_ref = run(lm, cache_ref, second)
    got, cache_pallas = run(pallas, cache_pallas, second)
    assert rel(got, want) < 1e-4
    assert rel(cache_pallas.mla, cache_ref.mla) < 1e-5 and rel(cache_pallas.kda_state, cache_ref.kda_state) < 1e-4


def test_decode_only_fast_path_matches_chunked_path(lm, rng):
    """decode_only steps run the fused single-token KDA op; it must equal the chunked path token for token."""
    ids = rng.integers(0, lm.config.vocab_size, 9).tolist()
    table = [[1, 2, 3]]
    _, cache_a = run(lm, new_cache(lm), make_step([ids[:6]], [0], tables=table, slots=[1]))
    _, cache_b = run(lm, new_cache(lm), make_step([ids[:6]], [0], tables=table, slots=[1]))
    for pos in range(6, 9):
        want, cache_a = run(lm, cache_a, make_step([[ids[pos]]], [pos], tables=table, slots=[1]))
        step = StepInputs(token_ids=jnp.asarray([ids[pos]], jnp.int32), cu_seqlens=jnp.asarray([0, 1], jnp.int32),
                          context_lens=jnp.asarray([pos], jnp.int32), block_tables=jnp.asarray([table[0]], jnp.int32),
                          state_slots=jnp.asarray([1], jnp.int32), logits_indices=jnp.asarray([0], jnp.int32),
                          checkpoint_positions=jnp.zeros((1, 0), jnp.int32),
                          checkpoint_slots=jnp.zeros((1, 0), jnp.int32), decode_only=True)
        got, cache_b = lm.step(cache_b, step)
        assert rel(got, want) < 1e-4


def test_fp8_cache_equals_quantise_dequantise_emulation(lm, rng, monkeypatch):
    """An e4m3 MLA cache (one f32 scale per token and layer) gives exactly the logits of an f32 cache that
    stores the quantised-then-dequantised latents (1e-5), over chunked prefill + decode and in both MLA forms
    (1e-4); it really quantises (differs from the f32 cache) and writes scales only into the used pages."""
    ids = rng.integers(0, lm.config.vocab_size, 14).tolist()
    table = [[1, 2, 3, 4]]
    pieces = ((0, 9), (9, 10), (10, 11), (11, 14))

    def chunked(model, cache):
        got = []
        for start, end in pieces:
            logits, cache = run(model, cache, make_step([ids[start:end]], [start], tables=table, slots=[1]))
            got.append(logits)
        return np.concatenate(got), cache

    fp8 = lambda: init_cache(lm.config, num_blocks=32, block_size=BS, num_slots=8, dtype=jnp.float8_e4m3fn)
    absorbed, cache = chunked(lm, fp8())
    assert cache.mla.dtype == jnp.float8_e4m3fn and cache.mla_scales.shape == cache.mla.shape[:3]
    scales = np.asarray(cache.mla_scales)
    assert (scales[:, 1:5].reshape(scales.shape[0], -1)[:, :len(ids)] > 0).all() and not scales[:, 5:].any()
    unabsorbed, _ = chunked(KimiLM(lm.model, mla_form="unabsorbed"), fp8())
    assert rel(unabsorbed, absorbed) < 1e-4
    full, _ = chunked(lm, new_cache(lm))
    assert rel(absorbed, full) > 1e-4

    write = mla_layers.mla_ops.write_latent_cache

    def write_rounded(pages, latent, slots, *, layer=None):
        rows, row_scales = quantize_latent_fp8(latent)
        return write(pages, rows.astype(jnp.float32) * row_scales[:, None], slots, layer=layer)

    monkeypatch.setattr(mla_layers.mla_ops, "write_latent_cache", write_rounded)
    emulated, _ = chunked(KimiLM(lm.model), new_cache(lm))
    assert rel(absorbed, emulated) < 1e-5


@pytest.mark.parametrize("split_v,skinny_rows", [(None, 0), (4, 64), (64, 8)])  # (64, 8): the split-V defaults; 64 > V
def test_pallas_decode_step_matches_reference(lm, rng, monkeypatch, split_v, skinny_rows):
    """A decode_only step with every Pallas kernel (interpret mode: fused or split-V KDA decode over the stacked
    state pools, absorbed MLA, grouped expert GEMMs, and with ``skinny_rows`` every dense projection through the
    grouped GEMM on its layer stack) equals the reference ops, cache included."""
    from kimi_jax.layers import common
    from pallas_kernels import tuning
    from pallas_kernels.kda import KDADecodeConfig

    import pallas_kernels.mxfp4 as gemm_ops

    decode_config = KDADecodeConfig(split_v=split_v or 0, fused_max_rows=0)  # split_v decides, whatever the batch
    monkeypatch.setattr(common, "SKINNY_MAX_ROWS", skinny_rows)
    dense_calls = []
    grouped = gemm_ops.grouped_matmul_concat

    def counting(x, ws, *args, **kwargs):
        dense_calls.extend(w.shape for w in ws if w.shape[1] == 1)  # [L, 1, in, out] views of dense stacks
        return grouped(x, ws, *args, **kwargs)

    monkeypatch.setattr(gemm_ops, "grouped_matmul_concat", counting)
    ids = rng.integers(0, lm.config.vocab_size, 7).tolist()
    table = [[1, 2, 3]]
    _, cache = run(lm, new_cache(lm), make_step([ids[:6]], [0], tables=table, slots=[2]))
    step = StepInputs(token_ids=jnp.asarray([ids[6]], jnp.int32), cu_seqlens=jnp.asarray([0, 1], jnp.int32),
                      context_lens=jnp.asarray([6], jnp.int32), block_tables=jnp.asarray([table[0]], jnp.int32),
                      state_slots=jnp.asarray([2], jnp.int32), logits_indices=jnp.asarray([0], jnp.int32),
                      checkpoint_positions=jnp.zeros((1, 0), jnp.int32),
                      checkpoint_slots=jnp.zeros((1, 0), jnp.int32), decode_only=True)
    with tuning.overriding(decode_config):
        got, cache_got = KimiLM(lm.model, impl="pallas").step(jax.tree.map(jnp.copy, cache), step)  # step donates
    want, cache_want = lm.step(cache, step)
    assert bool(dense_calls) == bool(skinny_rows)
    assert rel(got, want) < 1e-4
    live = slice(1, None)  # slot 0 is the scratch slot of KimiLM.step's padding sequences: garbage either way
    assert rel(cache_got.kda_state[:, live], cache_want.kda_state[:, live]) < 1e-5
    assert rel(cache_got.kda_conv[:, live], cache_want.kda_conv[:, live]) < 1e-6


def test_one_token_step_writes_the_page_pool_in_place(lm):
    """A one-token step scatters its latent into the donated page pool in place. XLA rewrites a one-row scatter
    as a dynamic-update-slice, which the CPU backend applied to a copy of the whole pool: about 600 ms per decode
    step of the tiny preset with max_num_seqs=1, against 10 ms with two rows."""
    import re

    cache = new_cache(lm, num_blocks=256)
    step = StepInputs(token_ids=jnp.asarray([3], jnp.int32), cu_seqlens=jnp.asarray([0, 1], jnp.int32),
                      context_lens=jnp.asarray([6], jnp.int32), block_tables=jnp.asarray([[1, 2, 3]], jnp.int32),
                      state_slots=jnp.asarray([2], jnp.int32), logits_indices=jnp.asarray([0], jnp.int32),
                      checkpoint_positions=jnp.zeros((1, 0), jnp.int32),
                      checkpoint_slots=jnp.zeros((1, 0), jnp.int32), decode_only=True)
    text = lm._step.lower(lm._state, cache, step).compile().as_text()  # unpadded: like the engine's T=1 bucket
    shape = cache.mla.shape
    flat = (shape[0] * shape[1] * shape[2], shape[3])
    for dims in (shape, flat):
        assert not re.search(rf"\[{','.join(map(str, dims))}\]\S* copy\(", text), dims
