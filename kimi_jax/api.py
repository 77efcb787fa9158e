"""The notebook-facing model API: ``kimi_jax.load(...)`` -> :class:`KimiLM` with ``.logits`` and ``.generate``.

``generate`` runs the same packed-step forward the serving engine uses: one prefill step over all prompts
(ragged, no padding between them), then one decode step per new token, with the caches donated.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.presets import PRESETS, get_preset
from kimi_jax.step import HybridCache, StepInputs, init_cache

BLOCK_SIZE = 16


class KimiLM:
    """A loaded model plus jitted helpers. ``model`` is the nnx module; ``config`` its ModelConfig.

    ``parallel``: the ``sharding.Parallel`` of the mesh the parameters are placed on (``kimi_jax.load`` with
    parallelism flags), or None for one device; caches from :meth:`new_cache` are then placed on it too.
    ``vision``: the checkpoint's vision tower + projector (``kimi_jax.vision.VisionModel``), or None."""

    def __init__(self, model: KimiModel, *, impl: str | None = None, mla_form: str = "absorbed", parallel=None,
                 vision=None):
        self.model = model
        self.vision = vision
        self.config: ModelConfig = model.config
        self.impl = impl
        self.parallel = parallel
        graphdef, state = nnx.split(model)
        self._graphdef = graphdef
        self._state = state
        self._step = jax.jit(functools.partial(_run_step, graphdef, impl=impl, mla_form=mla_form,
                                               parallel=parallel), donate_argnums=(1,))

    @property
    def dtype(self):
        return self.model.dtype

    def new_cache(self, num_seqs: int, max_len: int) -> HybridCache:
        """Zeroed pools for ``num_seqs`` sequences of up to ``max_len`` tokens (block 0 / slot 0 reserved)."""
        pages = -(-max_len // BLOCK_SIZE)
        if self.parallel is None:
            return init_cache(self.config, num_blocks=1 + num_seqs * pages, block_size=BLOCK_SIZE,
                              num_slots=1 + num_seqs, dtype=self.dtype)
        from sharding.place import zero_cache

        dcp = self.parallel.dcp
        return zero_cache(self.config, self.parallel.mesh, num_blocks=-(-(1 + num_seqs * pages) // dcp) * dcp,
                          block_size=BLOCK_SIZE, num_slots=1 + num_seqs, dtype=self.dtype)

    def step(self, cache: HybridCache, step: StepInputs) -> tuple[jax.Array, HybridCache]:
        """One packed step: -> (fp32 logits of ``step.logits_indices`` [M, vocab], new cache). Donates ``cache``.

        Token, sequence and row counts are padded up to powers of two first, so repeated calls with similar
        sizes reuse one compiled program."""
        num_rows = step.logits_indices.shape[0]
        logits, cache = self._step(self._state, cache, pad_step(step))
        return logits[:num_rows], cache

    def logits(self, input_ids) -> jax.Array:
        """Full forward without a persistent cache: int ``[B, T]`` -> fp32 logits ``[B, T, vocab]``."""
        ids = np.asarray(input_ids, np.int32)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {ids.shape}")
        b, t = ids.shape
        step = _packed_step([list(r) for r in ids], [0] * b, max_len=t, all_rows=True)
        logits, _ = self.step(self.new_cache(b, t), step)
        return logits.reshape(b, t, -1)

    def generate(self, prompts, *, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] | None = None,
                 media: jax.Array | None = None) -> list[list[int]]:
        """Decode continuations of token-id prompts (a list of lists or an int array ``[B, T]``).

        Greedy when ``temperature == 0``. Returns each prompt followed by its new tokens (generation of a
        sequence stops after a token in ``stop_token_ids``, default the config's EOS). ``media [R, D]``: rows
        that prompt ids ``vocab_size + r`` stand for (image tokens, see ``kimi_jax.vision.image_rows``)."""
        prompts = [list(map(int, p)) for p in (prompts.tolist() if isinstance(prompts, np.ndarray) else prompts)]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.config.vocab_size + (0 if media is None else media.shape[0])
        bad = [t for p in prompts for t in p if not 0 <= t < limit]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {limit}): {bad[:5]}")
        stops = set(stop_token_ids if stop_token_ids is not None else
                    ([self.config.eos_token_id] if self.config.eos_token_id is not None else []))
        n = len(prompts)
        max_len = max(map(len, prompts)) + max_new_tokens
        cache = self.new_cache(n, max_len)
        if media is not None:
            cache = dataclasses.replace(cache, media=jnp.asarray(media, self.dtype))
        key = jax.random.PRNGKey(seed)
        outputs = [list(p) for p in prompts]
        done = [False] * n
        step = _packed_step(prompts, [0] * n, max_len=max_len)
        for t in range(max_new_tokens):
            logits, cache = self.step(cache, step)
            key, sub = jax.random.split(key)
            tokens = np.asarray(_sample(logits, sub, temperature, top_k, top_p))
            for i in range(n):
                if not done[i]:
                    outputs[i].append(int(tokens[i]))
                    done[i] = int(tokens[i]) in stops
            if all(done) or t == max_new_tokens - 1:
                break
            step = _packed_step([[o[-1]] for o in outputs], [len(o) - 1 for o in outputs], max_len=max_len,
                                decode_only=True)
        return outputs


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def pad_step(step: StepInputs) -> StepInputs:
    """Pad T, N and M of a step to powers of two with inert padding (empty sequences on block 0 / slot 0)."""
    t, n, m = step.num_tokens, step.num_seqs, step.logits_indices.shape[0]
    tp, np_, mp = _bucket(t, 8), _bucket(n), _bucket(m)
    if step.decode_only:  # the fused decode path pairs row i with sequence i
        tp = np_ = _bucket(n, 8)
    if step.verify_len:  # the verify path pairs rows n*Tq .. n*Tq + Tq - 1 with sequence n
        np_ = _bucket(n)
        tp = np_ * step.verify_len
    if (tp, np_, mp) == (t, n, m):
        return step
    f = {k: np.asarray(v) for k, v in step.__dict__.items() if k not in ("decode_only", "verify_len")}
    pad_n = np_ - n
    return StepInputs(
        token_ids=jnp.asarray(np.pad(f["token_ids"], (0, tp - t))),
        cu_seqlens=jnp.asarray(np.pad(f["cu_seqlens"], (0, pad_n), mode="edge")),
        context_lens=jnp.asarray(np.pad(f["context_lens"], (0, pad_n))),
        block_tables=jnp.asarray(np.pad(f["block_tables"], ((0, pad_n), (0, 0)))),
        state_slots=jnp.asarray(np.pad(f["state_slots"], (0, pad_n))),
        logits_indices=jnp.asarray(np.pad(f["logits_indices"], (0, mp - m))),
        checkpoint_positions=jnp.asarray(np.pad(f["checkpoint_positions"], ((0, pad_n), (0, 0)), constant_values=-1)),
        checkpoint_slots=jnp.asarray(np.pad(f["checkpoint_slots"], ((0, pad_n), (0, 0)))),
        decode_only=step.decode_only, verify_len=step.verify_len)


def _run_step(graphdef, state, cache, step, *, impl, mla_form, parallel):
    model = nnx.merge(graphdef, state)
    hidden, cache = forward(model, cache, step, impl=impl, mla_form=mla_form, parallel=parallel)
    return compute_logits(model, hidden), cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _sample(logits, key, temperature: float, top_k: int, top_p: float):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        keep_sorted = cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1)


def _packed_step(seqs: list[list[int]], context: list[int], *, max_len: int, all_rows: bool = False,
                 decode_only: bool = False) -> StepInputs:
    """StepInputs for sequence i = ``seqs[i]`` new tokens after ``context[i]`` cached ones; sequence i owns
    slot i+1 and the pages ``1 + i*P ..`` (P = pages for ``max_len``)."""
    n = len(seqs)
    pages = -(-max_len // BLOCK_SIZE)
    lens = np.array([len(s) for s in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tables = 1 + np.arange(n, dtype=np.int32)[:, None] * pages + np.arange(pages, dtype=np.int32)
    rows = np.arange(cu[-1], dtype=np.int32) if all_rows else cu[1:] - 1
    return StepInputs(
        token_ids=jnp.asarray(np.concatenate([np.asarray(s, np.int32) for s in seqs])),
        cu_seqlens=jnp.asarray(cu), context_lens=jnp.asarray(np.asarray(context, np.int32)),
        block_tables=jnp.asarray(tables), state_slots=jnp.asarray(np.arange(1, n + 1, dtype=np.int32)),
        logits_indices=jnp.asarray(rows.astype(np.int32)),
        checkpoint_positions=jnp.full((n, 0), -1, jnp.int32), checkpoint_slots=jnp.zeros((n, 0), jnp.int32),
        decode_only=decode_only)


def _dtype(dtype) -> jnp.dtype:
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a floating dtype name like 'bfloat16' or 'float32', got {dtype!r}") from None


def load(path_or_preset: str, dtype="bfloat16", *, seed: int = 0, impl: str | None = None,
         progress: Callable[[int, int], None] | None = None, tensor_parallel_size: int = 1,
         decode_context_parallel_size: int = 1, enable_expert_parallel: bool = False, data_parallel_size: int = 1,
         num_hosts: int | None = None, host_rank: int | None = None, coordinator_address: str | None = None,
         mesh=None) -> KimiLM:
    """Load a checkpoint folder (hub layout) or build a preset (random weights unless the package ships them).

    ``dtype`` is the parameter/activation dtype (fp32 islands stay fp32); ``progress(done, total)`` is called
    after each stacked parameter is filled from the checkpoint (e.g. a tqdm bar).

    Parallelism (the flags of ``vllm serve``; ``sharding.layout`` documents them): ``tensor_parallel_size``,
    ``decode_context_parallel_size``, ``enable_expert_parallel``, and ``data_parallel_size`` only together with
    ``enable_expert_parallel`` (the DP ranks join the expert group; independent replicas are ``kimi_jax.LLM``'s);
    ``num_hosts`` / ``host_rank`` / ``coordinator_address`` start ``jax.distributed`` first. Or pass a ``mesh``
    from ``sharding.make_mesh``. A layout the model or the devices cannot take raises ValueError with the reason
    and the planner's suggested layouts. A checkpoint is read shard by shard onto its devices."""
    from kimi_jax.weights.loader import load_into

    dt = _dtype(dtype)
    parallel = _parallel_layout(path_or_preset, dt, mesh, dict(
        tensor_parallel_size=tensor_parallel_size, decode_context_parallel_size=decode_context_parallel_size,
        enable_expert_parallel=enable_expert_parallel, data_parallel_size=data_parallel_size, num_hosts=num_hosts,
        host_rank=host_rank, coordinator_address=coordinator_address))
    if os.path.isdir(path_or_preset):
        cfg = ModelConfig.from_json_file(os.path.join(path_or_preset, "config.json"))
        model = nnx.eval_shape(lambda: KimiModel(cfg, dtype=dt, rngs=nnx.Rngs(seed)))  # shapes only, no init
        layout = None if parallel is None else (parallel.mesh, parallel.shape.expert_parallel)
        return KimiLM(load_into(model, path_or_preset, progress=progress, layout=layout), impl=impl,
                      parallel=parallel, vision=_load_vision(path_or_preset, dt))
    if path_or_preset in PRESETS:
        shipped = shipped_checkpoint(path_or_preset)
        if shipped:
            return load(shipped, dtype, seed=seed, impl=impl, progress=progress, mesh=mesh if parallel is None
                        else parallel.mesh, enable_expert_parallel=enable_expert_parallel)
        model = KimiModel(get_preset(path_or_preset), dtype=dt, rngs=nnx.Rngs(seed))
        if parallel is not None:
            from sharding.place import shard_params

            shard_params(model, parallel.mesh, expert_parallel=parallel.shape.expert_parallel)
        return KimiLM(model, impl=impl, parallel=parallel)
    raise ValueError(f"{path_or_preset!r} is neither a checkpoint folder nor a preset ({sorted(PRESETS)})")


def _load_vision(folder: str, dtype):
    """The folder's vision tower (its config.json has a ``vision_config``), or None."""
    from kimi_jax.vision.weights import has_vision, load_vision

    return load_vision(folder, dtype=dtype) if has_vision(folder) else None


def _parallel_layout(path_or_preset: str, dtype, mesh, flags: dict):
    """The ``sharding.Parallel`` that ``load``'s flags (or ``mesh``) ask for, validated; None for one device."""
    from sharding.layout import ParallelConfig, device_memory_bytes, init_distributed, replica_meshes
    from sharding.parallel import parallel_for
    from sharding.planner import validate_layout

    pc = ParallelConfig(**flags)
    init_distributed(pc)
    if mesh is not None:
        return parallel_for(mesh, expert_parallel=pc.enable_expert_parallel)
    if pc.num_devices == 1:
        return None
    if pc.num_replicas > 1:
        raise ValueError(f"kimi_jax.load builds one model; --data-parallel-size {pc.data_parallel_size} without "
                         "--enable-expert-parallel means independent replicas: use kimi_jax.LLM or kimi-jax serve")
    if os.path.isdir(path_or_preset):
        cfg = ModelConfig.from_json_file(os.path.join(path_or_preset, "config.json"))
    elif path_or_preset in PRESETS:
        cfg = get_preset(path_or_preset)
    else:
        raise ValueError(f"{path_or_preset!r} is neither a checkpoint folder nor a preset ({sorted(PRESETS)})")
    validate_layout(cfg, pc, num_devices=jax.device_count(), hbm_bytes=device_memory_bytes(), context_len=1,
                    weight_dtype=str(jnp.dtype(dtype)))
    return parallel_for(replica_meshes(pc)[0], expert_parallel=pc.enable_expert_parallel)


def shipped_checkpoint(preset: str) -> str | None:
    """Folder of a checkpoint shipped inside the package for ``preset`` (the trained tiny model), if any."""
    folder = os.path.join(os.path.dirname(__file__), "assets", preset)
    return folder if os.path.exists(os.path.join(folder, "config.json")) else None
