"""Per-step inputs and the hybrid cache: the two pytrees that cross the jit boundary of a model step.

A step is a packed ragged batch: the tokens of N sequences (prefill chunks or single decode tokens)
concatenated into ``token_ids [T]`` and described by ``cu_seqlens [N+1]``. Rows past ``cu_seqlens[N]`` are
padding. Block 0 of the MLA pool and slot 0 of the KDA pool are scratch that padded sequences point at.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig


@partial(jax.tree_util.register_dataclass,
         data_fields=["token_ids", "cu_seqlens", "context_lens", "block_tables", "state_slots", "logits_indices",
                      "checkpoint_positions", "checkpoint_slots"],
         meta_fields=["decode_only", "verify_len"])
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One packed ragged step (all int32).

    token_ids            [T]      tokens of all sequences, padded with anything (e.g. 0)
    cu_seqlens           [N+1]    sequence n owns rows cu_seqlens[n]:cu_seqlens[n+1]; padded sequences are empty
    context_lens         [N]      tokens of sequence n already in the cache before this step (0 = fresh)
    block_tables         [N, P]   MLA pages of sequence n (page j holds positions j*block_size ...)
    state_slots          [N]      KDA slot holding sequence n's live recurrent + conv state
    logits_indices       [M]      rows whose final hidden states the step returns (usually each sequence's last)
    checkpoint_positions [N, Pc]  absolute token counts of sequence n at which to export the KDA state, -1 = none
    checkpoint_slots     [N, Pc]  destination slots of those checkpoints
    decode_only          static: every row is one token of a sequence with cached context (T == N, all
                         context_lens > 0, no checkpoints); KDA then runs the fused single-token kernel
    verify_len           static: 0, or Tq for a speculative-verification step: sequence n owns rows n*Tq ..
                         n*Tq + Tq - 1 (its last token, its drafts, padding), all with cached context, and the KDA
                         state after its t-th row goes to checkpoint_slots[n, t] where checkpoint_positions[n, t]
                         >= 0 (Pc == Tq); the live slot is read, not written
    """

    token_ids: jax.Array
    cu_seqlens: jax.Array
    context_lens: jax.Array
    block_tables: jax.Array
    state_slots: jax.Array
    logits_indices: jax.Array
    checkpoint_positions: jax.Array
    checkpoint_slots: jax.Array
    decode_only: bool = False
    verify_len: int = 0

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


@partial(jax.tree_util.register_dataclass,
         data_fields=["mla", "kda_state", "kda_conv", "mla_scales", "media", "draft"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Paged MLA latent pages and slot-indexed KDA state, stacked over layers of each kind.

    mla        [L_mla, num_blocks, block_size, R + K_rope]  normalised c_kv ++ un-rotated k_pe (bf16/f32, or e4m3)
    kda_state  [L_kda, S, HV, K, V]                         fp32 (or bf16) recurrent state
    kda_conv   [L_kda, S, W-1, 2*H*K + HV*V]                last W-1 pre-conv q/k/v inputs, oldest first
    mla_scales [L_mla, num_blocks, block_size] f32          per-token dequantisation scales of an fp8 ``mla``
                                                            (row ~= e4m3 row * scale); None otherwise
    media      [R, D] model dtype                           encoder outputs (merged vision tokens) of the images
                                                            being prefilled: a token id ``vocab_size + r`` in a
                                                            step stands for row r; None for a text-only engine
    draft      HybridCache or None                          a draft model's own pools (speculative decoding),
                                                            indexed by the same block ids and slot ids
    """

    mla: jax.Array
    kda_state: jax.Array
    kda_conv: jax.Array
    mla_scales: jax.Array | None = None
    media: jax.Array | None = None
    draft: "HybridCache | None" = None

    @property
    def fp8(self) -> bool:
        return self.mla_scales is not None

    def pools(self) -> dict[str, jax.Array]:
        """The page and slot pool arrays by field name (``mla_scales`` only for an fp8 cache; not ``media``, not
        the ``draft`` pools)."""
        names = ("mla", "kda_state", "kda_conv") + (("mla_scales",) if self.fp8 else ())
        return {name: getattr(self, name) for name in names}

    @property
    def block_size(self) -> int:
        return self.mla.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.mla.shape[1]

    @property
    def num_slots(self) -> int:
        return self.kda_state.shape[1]


def init_cache(cfg: ModelConfig, *, num_blocks: int, block_size: int, num_slots: int,
               dtype=jnp.bfloat16, state_dtype=jnp.float32, extra_mla_layers: int = 0, media_rows: int = 0,
               media_dtype=jnp.bfloat16) -> HybridCache:
    """Zero-initialised pools (``jnp.empty`` is uninitialised since jax 0.11: never use it for state).

    ``dtype`` is the MLA page dtype; ``float8_e4m3fn`` adds the per-token ``mla_scales`` pool.
    ``extra_mla_layers``: page layers after the model's own, for a drafter that caches latents of the same width
    at the same block ids. ``media_rows``: rows of the ``media`` pool (0: none)."""
    fp8 = jnp.dtype(dtype) == jnp.float8_e4m3fn
    num_mla = len(cfg.mla_layers) + extra_mla_layers
    return HybridCache(
        mla=jnp.zeros((num_mla, num_blocks, block_size, cfg.mla_cache_width), dtype),
        mla_scales=jnp.zeros((num_mla, num_blocks, block_size), jnp.float32) if fp8 else None,
        kda_state=jnp.zeros((len(cfg.kda_layers), num_slots, cfg.kda_num_v_heads, cfg.kda_head_dim,
                             cfg.kda_v_head_dim), state_dtype),
        kda_conv=jnp.zeros((len(cfg.kda_layers), num_slots, cfg.kda_conv_kernel - 1, cfg.kda_conv_channels),
                           jnp.float32),
        media=jnp.zeros((media_rows, cfg.hidden_size), media_dtype) if media_rows else None,
    )


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Per-token views derived from StepInputs inside the step.

    seq_ids   [T]  sequence of each row (N for padding rows)
    positions [T]  absolute position of each row within its sequence
    valid     [T]  row belongs to a sequence
    q_lens    [N]  new tokens of each sequence in this step
    """

    seq_ids: jax.Array
    positions: jax.Array
    valid: jax.Array
    q_lens: jax.Array


def token_layout(step: StepInputs) -> TokenLayout:
    rows = jnp.arange(step.num_tokens, dtype=jnp.int32)
    # "scan_unrolled": no while loop, which XLA:GPU would run by reading its predicate on the host (a sync)
    seq_ids = jnp.searchsorted(step.cu_seqlens, rows, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    valid = rows < step.cu_seqlens[-1]
    seq_ids = jnp.where(valid, seq_ids, step.num_seqs)
    safe = jnp.minimum(seq_ids, step.num_seqs - 1)
    positions = step.context_lens[safe] + rows - step.cu_seqlens[safe]
    q_lens = step.cu_seqlens[1:] - step.cu_seqlens[:-1]
    return TokenLayout(seq_ids=seq_ids, positions=jnp.where(valid, positions, 0), valid=valid, q_lens=q_lens)


def slot_mapping(step: StepInputs, layout: TokenLayout, block_size: int) -> jax.Array:
    """Flat cache row (block * block_size + offset) of each token, -1 for padding rows. [T] int32."""
    safe = jnp.minimum(layout.seq_ids, step.num_seqs - 1)
    block = step.block_tables[safe, layout.positions // block_size]
    return jnp.where(layout.valid, block * block_size + layout.positions % block_size, -1).astype(jnp.int32)


def dense_step(batch: int, length: int, *, block_size: int, context: np.ndarray | None = None,
               first_block: int = 1, first_slot: int = 1, max_len: int | None = None) -> dict[str, np.ndarray]:
    """Host-side StepInputs fields for ``batch`` sequences of ``length`` new tokens each (contiguous cache use).

    Sequence b owns slot ``first_slot + b`` and consecutive blocks starting at ``first_block + b * P`` where
    ``P = ceil(max_len / block_size)``; ``context`` gives tokens already cached per sequence (default 0).
    """
    max_len = max_len or length
    pages = -(-max_len // block_size)
    context = np.zeros(batch, np.int32) if context is None else np.asarray(context, np.int32)
    cu = np.arange(batch + 1, dtype=np.int32) * length
    tables = first_block + np.arange(batch, dtype=np.int32)[:, None] * pages + np.arange(pages, dtype=np.int32)
    return dict(cu_seqlens=cu, context_lens=context, block_tables=tables.astype(np.int32),
                state_slots=(first_slot + np.arange(batch)).astype(np.int32),
                logits_indices=(cu[1:] - 1).astype(np.int32),
                checkpoint_positions=np.full((batch, 0), -1, np.int32),
                checkpoint_slots=np.zeros((batch, 0), np.int32))
