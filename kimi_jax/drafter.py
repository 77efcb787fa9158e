"""DSpark-style block drafter (spec section 7.2): drafts a whole block of tokens in one forward pass.

The drafter reads the target's residual stream at a few layers (``target_layer_ids``: the "taps"; for AttnRes
models the running partial sum of the block). For every token the target processes, the taps are concatenated
and fused by ``fc`` into one vector, and each draft layer caches that vector's MLA latent in its own page layer
(the draft pages share block ids with the target's MLA pages, so prefix caching, copy-on-write and poisoning
cover them). To draft after the target accepted ``P`` tokens and produced the next token ``y``, a block of
``block_size`` rows at positions ``P .. P + k`` (``y`` then ``k`` mask rows, each with a learned block-position
embedding) runs through the draft layers: gated MLA (the target's MLA math, absorbed form over the paged
context, causal inside the block) and a GLU MLP, then the target's final norm and LM head (shared). Mask row
``i`` predicts the token at its own position. A low-rank Markov head adds ``markov_b[markov_a[x_{i-1}]]`` to row
``i``'s logits, where ``x_{i-1}`` is the token drafted (or, for row 1, ``y``) before it, which makes the block
semi-autoregressive at the cost of ``k`` tiny sequential steps; a confidence head estimates each row's
acceptance probability so drafting can stop early.

Deviation from K3's published drafter: positions inside the block come from learned embeddings, not RoPE in
the attention (our MLA is NoPE and the drafter reuses its kernels); the context entries are the same fused-tap
latents in every draft layer, as in DFlash.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.common import F32, constant, fan_in_normal, normal, rms_norm, stacked_linear
from kimi_jax.layers.ffn import DenseMLPStack, dense_mlp
from kimi_jax.layers.mla import MLAStack, context_latent, mla_layer, write_latent
from kimi_jax.step import StepInputs, TokenLayout, slot_mapping, token_layout
from pallas_kernels.rmsnorm import total


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """A drafter's architecture (its ``config.json``, beside the weights).

    target_layer_ids   0-indexed target layers whose residual stream is tapped
    num_layers         draft layers (gated MLA + GLU MLP, the target's widths)
    block_size         rows per drafted block: the current token + ``block_size - 1`` drafts (<= 8)
    markov_rank        rank of the Markov head's ``[vocab, r] @ [r, vocab]`` logit bias (0 = none)
    intermediate_size  the draft MLPs' width (None = the target's dense MLP width)
    """

    target_layer_ids: tuple[int, ...]
    num_layers: int = 1
    block_size: int = 8
    markov_rank: int = 32
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target_layer_ids:
            raise ValueError("DSparkConfig.target_layer_ids must name at least one target layer")
        if self.num_layers < 1:
            raise ValueError(f"DSparkConfig.num_layers must be >= 1, got {self.num_layers}")
        if not 2 <= self.block_size <= 8:
            raise ValueError(f"DSparkConfig.block_size must be in [2, 8] (verification takes <= 8 tokens), "
                             f"got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"DSparkConfig.markov_rank must be >= 0, got {self.markov_rank}")

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    def check_target(self, target: ModelConfig) -> None:
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(f"DSparkConfig.target_layer_ids {bad} are not layers of the {target.num_layers}-layer "
                             "target")

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The draft layers as a ModelConfig: the target's widths, ``num_layers`` MLA + dense-MLP layers."""
        n = self.num_layers
        return dataclasses.replace(target, num_layers=n, layer_types=("mla",) * n, mlp_types=("dense",) * n,
                                   intermediate_size=self.intermediate_size or target.intermediate_size,
                                   attn_res_block_size=0)

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": "dspark", **dataclasses.asdict(self),
                "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        d = dict(d)
        if d.pop("architecture", "dspark") != "dspark":
            raise ValueError(f"not a DSpark drafter config: architecture={d.get('architecture')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown DSpark config fields: {unknown}")
        return cls(**d)

    @classmethod
    def from_folder(cls, folder: str) -> "DSparkConfig":
        with open(os.path.join(folder, "config.json")) as f:
            return cls.from_dict(json.load(f))


class DSparkDrafter(nnx.Module):
    """Parameters: fc [n_taps * D, D], fc_norm [D], mask_embed [D], block_pos [block_size, D]; draft layers
    mla (MLAStack), input_norm / post_attn_norm [n, D], mlp (DenseMLPStack); norm [D]; markov_a [vocab, r],
    markov_b [r, vocab]; confidence [D], confidence_bias [1]. The embedding, final norm and LM head are the
    target's."""

    def __init__(self, cfg: DSparkConfig, target: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        cfg.check_target(target)
        self.config = cfg
        self.target_config = target
        lc = cfg.layer_config(target)
        d, n = target.hidden_size, cfg.num_layers
        self.fc = fan_in_normal(rngs, (1, len(cfg.target_layer_ids) * d, d), dtype)
        self.fc_norm = constant((d,), 1.0)
        self.mask_embed = normal(rngs, (d,), 1.0, dtype)
        self.block_pos = normal(rngs, (cfg.block_size, d), 0.02, dtype)
        self.mla = MLAStack(lc, dtype=dtype, rngs=rngs)
        self.input_norm = constant((n, d), 1.0)
        self.post_attn_norm = constant((n, d), 1.0)
        self.mlp = DenseMLPStack(lc, dtype=dtype, rngs=rngs)
        self.norm = constant((d,), 1.0)
        r = max(cfg.markov_rank, 1)
        self.markov_a = normal(rngs, (target.vocab_size, r), 0.02 if cfg.markov_rank else 0.0, dtype)
        self.markov_b = constant((r, target.vocab_size), 0.0, dtype)
        self.confidence = constant((d,), 0.0)
        self.confidence_bias = constant((1,), 0.0)

    @property
    def layer_config(self) -> ModelConfig:
        return self.config.layer_config(self.target_config)


def fuse_taps(d: DSparkDrafter, taps: jax.Array, *, impl: str | None = None) -> jax.Array:
    """taps [n_taps, T, D] f32 (``forward(..., taps=...)``) -> the context vector of each row [T, D]."""
    n_taps, t_rows, dim = taps.shape
    x = jnp.transpose(taps, (1, 0, 2)).reshape(t_rows, n_taps * dim).astype(d.fc.dtype)
    return rms_norm(stacked_linear(x, d.fc, 0, impl=impl), d.fc_norm[...], d.target_config.rms_norm_eps)


def write_context(d: DSparkDrafter, pages: jax.Array, scales: jax.Array | None, fused: jax.Array, step: StepInputs,
                  layout: TokenLayout, page_offset: int, *, impl: str | None = None
                  ) -> tuple[jax.Array, jax.Array | None]:
    """Cache every valid row's context latent in each draft layer's pages (``page_offset + l``), at the rows'
    positions: what later draft blocks attend to."""
    slots = slot_mapping(step, layout, pages.shape[2])
    lc = d.layer_config
    for layer in range(d.config.num_layers):
        pages, scales = write_latent(pages, scales, context_latent(d.mla, layer, fused, lc, impl=impl), slots,
                                     page_offset + layer)
    return pages, scales


def block_step(first_tokens: jax.Array, positions: jax.Array, block_tables: jax.Array, block_size: int
               ) -> StepInputs:
    """The drafting step: sequence n's block sits at positions ``positions[n] .. + block_size - 1`` (its first row
    is ``first_tokens[n]``, the rest are mask rows), over the context cached before ``positions[n]``."""
    n = first_tokens.shape[0]
    rows = n * block_size
    tokens = jnp.zeros((n, block_size), jnp.int32).at[:, 0].set(first_tokens).reshape(rows)
    return StepInputs(
        token_ids=tokens, cu_seqlens=(jnp.arange(n + 1, dtype=jnp.int32) * block_size),
        context_lens=positions.astype(jnp.int32), block_tables=block_tables,
        state_slots=jnp.zeros(n, jnp.int32), logits_indices=jnp.arange(rows, dtype=jnp.int32),
        checkpoint_positions=jnp.full((n, 0), -1, jnp.int32), checkpoint_slots=jnp.zeros((n, 0), jnp.int32))


def block_hidden(d: DSparkDrafter, embed: jax.Array, pages: jax.Array, scales: jax.Array | None, step: StepInputs,
                 page_offset: int, *, impl: str | None = None, finite_pages: bool = True
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The draft layers over a block step of ``B <= block_size`` rows per sequence: -> (hidden [N*B, D] before the
    target's final norm, pages, scales). The layers are causal within the block, so a block shorter than the
    drafter's (fewer drafts verified than it was trained for) gives the same first B rows as the whole block."""
    lc = d.layer_config
    n = step.num_seqs
    b = step.token_ids.shape[0] // n
    if not 1 <= b <= d.config.block_size:
        raise ValueError(f"a block step of {b} rows per sequence; the drafter's blocks hold {d.config.block_size}")
    layout = token_layout(step)
    first = embed[step.token_ids.reshape(n, b)[:, 0]]
    rows = jnp.concatenate([first[:, None], jnp.broadcast_to(d.mask_embed[...], (n, b - 1, first.shape[-1]))], 1)
    x = (rows + d.block_pos[...][None, :b]).reshape(n * b, -1).astype(embed.dtype)
    for layer in range(d.config.num_layers):
        h = rms_norm(x, d.input_norm[layer], lc.rms_norm_eps)
        a, pages, scales = mla_layer(d.mla, layer, h, pages, scales, step, layout, lc, impl=impl, form="absorbed",
                                     finite_pages=finite_pages, page_layer=page_offset + layer)
        x = (x.astype(F32) + total(a, F32)).astype(x.dtype)
        h = rms_norm(x, d.post_attn_norm[layer], lc.rms_norm_eps)
        x = (x.astype(F32) + total(dense_mlp(d.mlp, layer, h, lc, impl=impl), F32)).astype(x.dtype)
    return x, pages, scales


def markov_bias(d: DSparkDrafter, previous: jax.Array) -> jax.Array:
    """previous [...] int32 -> the Markov head's logit bias [..., vocab] f32."""
    if not d.config.markov_rank:
        return jnp.zeros(previous.shape + (d.target_config.vocab_size,), F32)
    return jnp.einsum("...r,rv->...v", d.markov_a[...][previous], d.markov_b[...], preferred_element_type=F32)


def confidence(d: DSparkDrafter, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> the estimated probability [...] that the target accepts the row's draft."""
    return jax.nn.sigmoid(jnp.einsum("...d,d->...", hidden.astype(F32), d.confidence[...]) + d.confidence_bias[0])
