"""EngineConfig: every engine setting (scheduling, cache pools, buckets, sampling limits, test mode).

Fields left ``None`` take a default that depends on the platform and the model; ``resolve()`` fills them in
and validates everything, raising ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import math

from serve.engine.buckets import Buckets, default_buckets
from serve.engine.sampling_params import MAX_LOGPROBS
from serve.engine.spec_config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")
MXFP4_BYTE_ORDERS = ("auto", "checkpoint", "pairs", "words")
WARM_UP_MODES = ("full", "progressive")
_KV_CACHE_JNP = {"bfloat16": "bfloat16", "float32": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
CPU_MEMORY_BUDGET = 64 << 20
"""Default cache budget on CPU (both pools together)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. ``None`` = platform default (CPU / GPU):

    max_model_len              prompt + output tokens per request (min(model limit, 2048 / 32768))
    max_num_seqs               sequences per step (16 / 128)
    max_num_batched_tokens     tokens per step, the chunked-prefill budget (256 / 4096)
    block_size                 tokens per MLA page, the prefix-match unit (16 / 64: long-context decode on a
                               Hopper GPU takes the Mosaic-GPU MLA kernel, which steps 64 keys of one page)
    enable_prefix_caching      share pages and restore KDA checkpoints (on by default)
    prefix_cache_retention_interval   also checkpoint KDA state every this many tokens (0 = prompt ends only)
    max_checkpoints_per_seq    checkpoint exports one sequence may do in one step (static width Pc)
    num_checkpoint_slots       KDA slots beyond the live ones, for checkpoints (max_num_seqs with prefix caching)
    num_blocks_override        use only this many MLA pages (incl. the reserved one), e.g. to force preemption
    kv_cache_dtype             MLA page dtype: "auto" (the model's), "bfloat16", "float32", or "fp8" / "fp8_e4m3"
                               (e4m3 rows with one f32 scale per token and layer: 580 vs 1152 bytes per token)
    memory_budget_bytes        bytes for both pools (CPU: 64 MiB; GPU: gpu_memory_utilization of the device
                               limit minus what is in use after the weights, minus activation_reserve_bytes)
    token_buckets / seq_buckets / page_buckets   precompiled T / N / P sizes (``buckets.default_buckets``)
    mxfp4_byte_order           MXFP4 expert bytes as served: "checkpoint", "pairs" or "words" (re-laid in place
                               at start, one layer at a time: ``kimi_jax.model.use_serving_byte_order``), or "auto"
                               (words when the Pallas kernels run on a GPU and the input widths are multiples of
                               128, else pairs where they are of 64: grouped GEMMs 1.6-1.9x / 1.3-1.5x faster than
                               the checkpoint order's on the H200)
    max_logprobs               most top logprobs a request may ask for (computed on device when asked)
    seed                       draws the seeds of requests that do not set one
    async_scheduling           schedule and launch step n+1 while step n runs when every running request is
                               decoding (tokens fed from the device; ``Scheduler.schedule_ahead``)
    test_mode                  fill freed pages and slots with NaN so that a stale read shows up
    compile_threads            threads compiling buckets at warm-up (default: CPU count, at most 8)
    warm_up                    "full": start serving once every bucket is compiled; "progressive": once the largest
                               buckets are (any step fits them), the others compiling in the background and each
                               taken into use as it is ready (``ModelRunner.warm_up``; one process only)
    executable_cache_dir       keep compiled step executables here and load them at the next start, skipping
                               tracing, lowering and compiling (``executable_cache``; None = off; ``kimi-jax serve`` on
                               a GPU: ``$KIMI_JAX_COMPILE_CACHE/executables``)
    speculative_config         speculative decoding (``SpeculativeConfig``, its dict or its JSON; None = off):
                               verification buckets are compiled beside the others, and the KDA pool gets
                               1 + k spare slots per sequence for the states after each verified token; a
                               ``disable_by_batch_size`` below the largest sequence bucket becomes a sequence
                               bucket, so that the buckets past it (which never speculate) compile without drafting
    encoder_batch_size         images per vision encoder launch (models with a vision tower)
    media_pool_rows            merged vision tokens the media pool holds at once (default: max of
                               max_num_batched_tokens and 4 of the largest images)
    """

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_retention_interval: int = 0
    max_checkpoints_per_seq: int = 4
    num_checkpoint_slots: int | None = None
    num_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    memory_budget_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 4 << 30
    mxfp4_byte_order: str = "auto"
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    max_logprobs: int = MAX_LOGPROBS
    seed: int = 0
    async_scheduling: bool = True
    test_mode: bool = False
    compile_threads: int | None = None
    warm_up: str = "full"
    executable_cache_dir: str | None = None
    speculative_config: SpeculativeConfig | None = None
    encoder_batch_size: int = 4
    media_pool_rows: int | None = None

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_json(spec))

    @property
    def num_speculative_slots(self) -> int:
        """KDA slots reserved for verification: 1 + k per sequence that may speculate (fewer than
        ``disable_by_batch_size``), twice over with a device drafter, whose verification steps are chained two in
        flight (0 without speculation)."""
        spec = self.speculative_config
        if spec is None:
            return 0
        seqs = self.max_num_seqs
        if spec.disable_by_batch_size:
            seqs = min(seqs, spec.disable_by_batch_size - 1)
        return (2 if spec.on_device else 1) * seqs * (1 + spec.num_speculative_tokens)

    @property
    def max_pages(self) -> int:
        """Block-table width of a full-length request."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def buckets(self) -> Buckets:
        return Buckets(self.token_buckets, self.seq_buckets, self.page_buckets)

    def resolve(self, model_config, *, gpu: bool) -> "EngineConfig":
        """A copy with every ``None`` filled in for ``model_config`` (a ModelConfig) on this platform, validated."""
        max_model_len = self.max_model_len or min(model_config.max_position_embeddings, 32768 if gpu else 2048)
        max_num_seqs = self.max_num_seqs or (128 if gpu else 16)
        max_tokens = self.max_num_batched_tokens or max(4096 if gpu else 256, max_num_seqs)
        cfg = dataclasses.replace(
            self, block_size=self.block_size or (64 if gpu else 16), max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
            num_checkpoint_slots=(self.num_checkpoint_slots if self.num_checkpoint_slots is not None
                                  else max_num_seqs if self.enable_prefix_caching else 0),
            compile_threads=self.compile_threads or 0)
        cfg._validate_scalars(model_config)
        defaults = default_buckets(max_num_batched_tokens=max_tokens, max_num_seqs=max_num_seqs,
                                   max_pages=cfg.max_pages, gpu=gpu)
        seqs = tuple(self.seq_buckets or defaults.seqs)
        spec = self.speculative_config
        if spec is not None and 0 < spec.disable_by_batch_size < max(seqs):
            seqs = tuple(sorted({*seqs, spec.disable_by_batch_size}))
        cfg = dataclasses.replace(cfg, token_buckets=tuple(self.token_buckets or defaults.tokens),
                                  seq_buckets=seqs,
                                  page_buckets=tuple(self.page_buckets or defaults.pages))
        cfg.validate(model_config)
        return cfg

    def validate(self, model_config) -> None:
        """Raise ValueError naming the first bad field (every field must be resolved)."""
        self._validate_scalars(model_config)
        try:
            self.buckets.check_covers(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, max_pages=self.max_pages)
        except ValueError as e:
            raise ValueError(f"EngineConfig buckets: {e}") from None

    def _validate_scalars(self, model_config) -> None:
        _require(self.max_model_len >= 2, "max_model_len", f"must be >= 2, got {self.max_model_len}")
        _require(self.max_model_len <= model_config.max_position_embeddings, "max_model_len",
                 f"{self.max_model_len} exceeds the model's limit {model_config.max_position_embeddings}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})")
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.prefix_cache_retention_interval >= 0, "prefix_cache_retention_interval",
                 f"must be >= 0, got {self.prefix_cache_retention_interval}")
        _require(self.max_checkpoints_per_seq >= 1, "max_checkpoints_per_seq",
                 f"must be >= 1, got {self.max_checkpoints_per_seq}")
        _require(self.num_checkpoint_slots >= 0, "num_checkpoint_slots",
                 f"must be >= 0, got {self.num_checkpoint_slots}")
        _require(self.num_blocks_override is None or self.num_blocks_override >= 2, "num_blocks_override",
                 f"must be None or >= 2, got {self.num_blocks_override}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.mxfp4_byte_order in MXFP4_BYTE_ORDERS, "mxfp4_byte_order",
                 f"must be one of {MXFP4_BYTE_ORDERS}, got {self.mxfp4_byte_order!r}")
        _require(self.memory_budget_bytes is None or self.memory_budget_bytes > 0, "memory_budget_bytes",
                 f"must be None or > 0, got {self.memory_budget_bytes}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(0 <= self.max_logprobs <= MAX_LOGPROBS, "max_logprobs",
                 f"must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        _require(self.encoder_batch_size >= 1, "encoder_batch_size", f"must be >= 1, got {self.encoder_batch_size}")
        _require(self.media_pool_rows is None or self.media_pool_rows >= 1, "media_pool_rows",
                 f"must be None or >= 1, got {self.media_pool_rows}")
        _require(self.warm_up in WARM_UP_MODES, "warm_up", f"must be one of {WARM_UP_MODES}, got {self.warm_up!r}")
        _require(self.compile_threads >= 0, "compile_threads", f"must be >= 0, got {self.compile_threads}")


def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype) -> str:
    """The jnp dtype name of the MLA pages for an ``EngineConfig.kv_cache_dtype`` ("auto" = the model's)."""
    return str(model_dtype) if kv_cache_dtype == "auto" else _KV_CACHE_JNP[kv_cache_dtype]


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field} {message}")
