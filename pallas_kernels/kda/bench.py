"""H200 benchmark of the KDA kernels: ours (Pallas) vs flash-linear-attention 0.6.0 vs our XLA reference.

One run measures the device ceilings (device-to-device copy bandwidth, bf16 8192^3 matmul rate), checks the
Pallas kernels against the references on fresh random inputs, then times prefill (bf16 inputs, K = V = 128,
in-kernel q/k L2 norm and gate) and decode (one token per sequence, fp32 or bf16 state pool) on the same
inputs for every implementation. Needs torch + FLA wheels (``bash ../shared/tools/peer-wheels.sh``).

Phases (so one ~8 minute call holds the full grid): (1) ceilings; (2) while child processes compile every
autotune config of FLA's kernels for each head count (each config launched once, timings faked and not
cached: ``--fla-warmup H``), the parent compiles our kernels and the XLA references and runs the correctness
checks (nothing is timed while the children run); (3) with the GPU to itself: ours, then FLA (its real
autotuning, now only benchmarking), then the XLA reference timings. The JSON is rewritten after every row,
so a timeout keeps what was measured.

Usage (repo root, GPU machine): ``PYTHONPATH=. python3 pallas_kernels/kda/bench.py [--suite quick|decode|full]``
(``decode``: the full suite's decode cases alone; decode rows also record each variant's profiler device time).
Writes ``kda_bench.json`` under ``$OUT`` (or the cwd) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch in the same process

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import kernel_split_us
from pallas_kernels.kda import ChunkKDAConfig, KDADecodeConfig, chunk_kda, fused_recurrent_kda
from pallas_kernels.kda.chunk import chunk_kda_pallas
from pallas_kernels.kda.decode_mgpu import fused_recurrent_kda_mgpu

CHUNK = 64
HEAD_DIM = 128
LOWER_BOUND = -5.0
CONV_WIDTH = 4
T0 = time.perf_counter()


def elapsed():
    return time.perf_counter() - T0


def time_jax(fn, *args, iters=20, repeats=5):
    """Median seconds per call of a jitted fn, issuing ``iters`` calls back to back per repeat."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def time_torch(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def to_torch(x):
    import torch

    return torch.from_dlpack(x)


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def device_ceilings():
    """Copy bandwidth (bytes read + written / s) and bf16 matmul FLOP/s, measured with torch."""
    import torch

    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    copy_s = time_torch(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = time_torch(lambda: a @ b)
    del x, y, a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * 2**31 / copy_s, "bf16_matmul_flops": 2 * 8192**3 / mm_s}


CHECK_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
"""Relative (norm) error bounds of the checks: fp32 inputs run exact fp32 dots (the CPU tests' 1e-4), bf16 inputs
bf16 dot operands (2e-2); the decode rows' bf16 inputs and pools, 2e-2."""


def check_tolerance(path: str) -> float | None:
    """The bound of a check result (``correctness_checks``' ``"float32 softplus"[i]`` or a decode row's error
    field), None for what is not a check."""
    if path.startswith("rows"):
        return CHECK_TOL["bfloat16"] if "err_vs_ref" in path else None
    return CHECK_TOL["bfloat16" if path.startswith("bfloat16") else "float32"]


def run_checks(report: dict, check, *args) -> list[str]:
    """Run ``check(*args)`` into ``report["checks"]`` -> its failures: a crash, no results, or an error over its
    bound."""
    report["checks"], failures = bench_checks.run(check, *args)
    return failures + bench_checks.over(report["checks"], check_tolerance)


def row_failures(report: dict) -> list[str]:
    """The rows' failures: a decode row's check over its bound, or a row whose own kernels did not compile or
    run (a reference's or FLA's failure is recorded, not a failed check)."""
    rows = {f"rows/{r['name'] if 'name' in r else (r['H'], r['B'], r['state_dtype'])}": r for r in report["rows"]}
    checked = {k: {f: v for f, v in r.items() if "err_vs_ref" in f} for k, r in rows.items() if r["kind"] == "decode"}
    return bench_checks.over(checked, check_tolerance) + [f"{k}: {r['error']}" for k, r in rows.items()
                                                          if r.get("error", "").startswith("ours")]


def correctness_checks(key):
    """Pallas vs reference on small varlen batches (GVA, initial states, checkpoints, both gates, fp32 and bf16)."""
    lengths = [0, 1, 200, 64, 77]
    positions = jnp.asarray([[0, -1], [1, 0], [130, 200], [64, 1], [33, 77]], jnp.int32)
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        for lower_bound in (None, LOWER_BOUND):
            key, sub, s0_key = jax.random.split(key, 3)
            x = prefill_inputs(sub, lengths, 2, 4, dtype)
            s0 = jax.random.normal(s0_key, (len(lengths), 4, HEAD_DIM, HEAD_DIM), jnp.float32)
            out = {impl: jax.jit(lambda x, s0, impl=impl: chunk_kda(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=s0, cu_seqlens=x["cu_seqlens"],
                checkpoint_positions=positions, use_qk_l2norm=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                lower_bound=lower_bound, impl=impl))(x, s0) for impl in ("pallas", "reference")}
            name = f"{jnp.dtype(dtype).name} {'softplus' if lower_bound is None else 'lower_bound'}"
            results[name] = [rel_err(a, b) for a, b in zip(out["pallas"], out["reference"])]
    for name, errs in results.items():
        print(f"check prefill {name}: rel err o {errs[0]:.1e} final {errs[1]:.1e} checkpoints {errs[2]:.1e}",
              flush=True)
    return results


# ----------------------------------------------------------------------------------------------------------------
# Prefill


def prefill_inputs(key, lengths, heads, value_heads, dtype=jnp.bfloat16):
    total = int(sum(lengths))
    ks = jax.random.split(key, 7)
    q = jax.random.normal(ks[0], (1, total, heads, HEAD_DIM), dtype)
    k = jax.random.normal(ks[1], (1, total, heads, HEAD_DIM), dtype)
    v = jax.random.normal(ks[2], (1, total, value_heads, HEAD_DIM), dtype)
    g = jax.random.normal(ks[3], (1, total, value_heads, HEAD_DIM), dtype)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, total, value_heads), jnp.float32)).astype(dtype)
    A_log = jax.random.uniform(ks[5], (value_heads,), jnp.float32, 0.0, 2.0)
    dt_bias = jax.random.normal(ks[6], (value_heads * HEAD_DIM,), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)


def prefill_flops(lengths, value_heads):
    """Matmul FLOPs of the chunked algorithm per chunk-head: A_kk, A_qk; solve for u, w; w S, qg S, A U, kg^T U."""
    C, K, V = CHUNK, HEAD_DIM, HEAD_DIM
    per_chunk = 4 * C * C * K + 2 * C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    chunks = sum(-(-n // C) for n in lengths)
    return per_chunk * chunks * value_heads


def prefill_bytes(lengths, heads, value_heads):
    """Fewest bytes: bf16 q, k, v, g, beta read once, bf16 o written, fp32 final states written."""
    total = sum(lengths)
    per_token = 2 * (2 * heads * HEAD_DIM + 2 * value_heads * HEAD_DIM + value_heads + value_heads * HEAD_DIM)
    return per_token * total + 4 * len(lengths) * value_heads * HEAD_DIM * HEAD_DIM


@functools.partial(jax.jit, static_argnames=("impl", "lower_bound"))
def prefill_call(q, k, v, g, beta, cu, A_log, dt_bias, *, impl, lower_bound):
    """(o, final_state) of one packed prefill; jitted once per shape / impl / gate and reused across phases."""
    return chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                     lower_bound=lower_bound, impl=impl)[:2]


def prefill_args(x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"], x["A_log"], x["dt_bias"])


SCAN_BV64_MIN_HEADS = 64
"""Prefill cases with at least this many value heads also time the scan at ``block_v`` 64."""


class PrefillCase:
    def __init__(self, name, lengths, heads, value_heads, lower_bound, with_reference, key):
        self.lengths = [int(n) for n in lengths]
        self.heads, self.value_heads, self.lower_bound, self.with_reference = heads, value_heads, lower_bound, \
            with_reference
        self.x = prefill_inputs(key, self.lengths, heads, value_heads)
        self.row = dict(kind="prefill", name=name, H=heads, HV=value_heads, tokens=int(sum(self.lengths)),
                        seqs=len(self.lengths), gate="lower_bound" if lower_bound is not None else "softplus",
                        flops=prefill_flops(self.lengths, value_heads),
                        bytes=prefill_bytes(self.lengths, heads, value_heads))
        self.out = None

    def call(self, impl):
        return prefill_call(*prefill_args(self.x), impl=impl, lower_bound=self.lower_bound)

    def compile(self, impl):
        """First call (compile + one run), recorded as ``{impl}_first_call_s``; keeps the Pallas output."""
        start = time.perf_counter()
        out = jax.block_until_ready(self.call(impl))
        self.row[f"{'ours' if impl == 'pallas' else 'xla_ref'}_first_call_s"] = time.perf_counter() - start
        if impl == "pallas":
            self.out = out
        else:
            o_ref, state_ref = out
            o, state = self.out if self.out is not None else self.call("pallas")
            self.row["err_vs_ref_o"], self.row["err_vs_ref_state"] = rel_err(o, o_ref), rel_err(state, state_ref)

    def time_ours(self):
        """Wall time (and on the GPU the per-launch device time) of our kernel and its variants, each with its
        error against the default's output: for the softplus gate its diagonal launch in the dyadic form on every
        block (``ours_dyadic_*``; the default takes the midpoint form per block where the span allows); from
        :data:`SCAN_BV64_MIN_HEADS` heads the scan over 64 V columns per program (``ours_scan_bv64_*``: half the
        re-reads of w, qg, kg and A_qk, which every V block of a head loads, while the tuned 32, chosen at H32, keeps
        enough programs to fill the GPU at fewer heads)."""
        variants = {"ours": lambda *a: prefill_call(*a, impl="pallas", lower_bound=self.lower_bound)}

        def with_config(config):
            return jax.jit(lambda q, k, v, g, beta, cu, A_log, dt_bias: chunk_kda_pallas(
                q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                lower_bound=self.lower_bound, config=config)[:2])

        if self.lower_bound is None:
            variants["ours_dyadic"] = with_config(ChunkKDAConfig(adaptive_diagonal=False))
        if self.value_heads >= SCAN_BV64_MIN_HEADS:
            variants["ours_scan_bv64"] = with_config(ChunkKDAConfig(block_v=64))
        args = prefill_args(self.x)
        for label, fn in variants.items():
            if label != "ours" and self.out is not None:
                self.row[f"{label}_rel_o"] = rel_err(fn(*args)[0], self.out[0])
            self.row[f"{label}_s"] = time_jax(fn, *args)
            print(f"{self.row['name']}: {label} {self.row[f'{label}_s'] * 1e3:.3f} ms", flush=True)
            if jax.devices()[0].platform == "gpu":  # which launch (diagonal blocks, intra-chunk, scan) takes the time
                self.row[f"{label}_kernel_us"] = kernel_split_us(fn, args)
                print(f"{self.row['name']}: {label} per kernel {self.row[f'{label}_kernel_us']}", flush=True)

    def time_reference(self):
        self.row["xla_ref_s"] = time_jax(lambda *a: prefill_call(*a, impl="reference", lower_bound=self.lower_bound),
                                         *prefill_args(self.x), iters=2, repeats=3)
        print(f"{self.row['name']}: xla reference {self.row['xla_ref_s'] * 1e3:.2f} ms", flush=True)

    def time_fla(self):
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        x, row = self.x, self.row
        t = {n: to_torch(x[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
        cu = to_torch(x["cu_seqlens"]).long()
        fla_kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"],
                      output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        if self.lower_bound is not None:
            fla_kw.update(safe_gate=True, lower_bound=self.lower_bound)
        with torch.inference_mode():
            fla = lambda: fla_chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **fla_kw)  # noqa: E731
            start = time.perf_counter()
            o_fla, state_fla = fla()
            torch.cuda.synchronize()
            row["fla_first_call_s"] = time.perf_counter() - start
            row["fla_s"] = time_torch(fla)
        o, state = self.out if self.out is not None else self.call("pallas")
        row["err_vs_fla_o"] = rel_err(o, o_fla.float().cpu().numpy())
        row["err_vs_fla_state"] = rel_err(state, state_fla.float().cpu().numpy())
        print(f"{row['name']}: fla {row['fla_s'] * 1e3:.3f} ms (first call {row['fla_first_call_s']:.1f} s)",
              flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Decode


def decode_inputs(key, batch, heads, state_dtype):
    hv, K, V = heads, HEAD_DIM, HEAD_DIM
    channels = 2 * heads * K + hv * V
    slots_total = batch + 1  # slot 0 is scratch
    ks = jax.random.split(key, 10)
    return dict(
        mixed_qkv=jax.random.normal(ks[0], (batch, channels), jnp.bfloat16),
        conv_weight=jax.random.normal(ks[1], (channels, CONV_WIDTH), jnp.float32) * 0.5,
        conv_state=jax.random.normal(ks[2], (slots_total, CONV_WIDTH - 1, channels), jnp.bfloat16),
        g_raw=jax.random.normal(ks[3], (batch, hv * K), jnp.bfloat16),
        beta_logits=jax.random.normal(ks[4], (batch, hv), jnp.bfloat16),
        A_log=jax.random.uniform(ks[5], (hv,), jnp.float32, 0.0, 2.0),
        dt_bias=jax.random.normal(ks[6], (hv * K,), jnp.float32),
        state=(jax.random.normal(ks[7], (slots_total, hv, K, V), jnp.float32) * 0.1).astype(state_dtype),
        slots=jnp.arange(1, batch + 1, dtype=jnp.int32),
        gate_logits=jax.random.normal(ks[8], (batch, hv * V), jnp.bfloat16),
        o_norm_weight=jax.random.uniform(ks[9], (V,), jnp.float32, 0.5, 1.5),
    )


ARG_ORDER = ("mixed_qkv", "conv_weight", "conv_state", "g_raw", "beta_logits", "A_log", "dt_bias", "state", "slots",
             "gate_logits", "o_norm_weight")
REST_ORDER = tuple(a for a in ARG_ORDER if a not in ("conv_state", "state"))


DECODE_BLOCK_V = (32, 64)
"""Extra V-slice widths of our decode kernel timed next to the default (whole V per program)."""
DECODE_SPLIT_V = (16, 32, 64)
"""Slice widths of the split-V decode kernel (one program per [K, split_v] slice; conv shift + norm in XLA)."""


@functools.partial(jax.jit, static_argnames=("impl", "block_v", "split_v"), donate_argnums=(0, 1))
def decode_step(conv_state, state, *rest, impl, block_v=None, split_v=None):
    """One decode step; ``split_v``: the split-V kernel at that width, whatever the batch (None: the tuned
    choice); ``block_v``: the fused kernel's state slices."""
    config = KDADecodeConfig(block_v=block_v, **(dict(split_v=split_v, fused_max_rows=0) if split_v else {}))
    return fused_recurrent_kda(conv_state=conv_state, state=state, lower_bound=LOWER_BOUND, impl=impl,
                               config=config, **dict(zip(REST_ORDER, rest)))


def num_sms() -> int:
    """Streaming multiprocessors of the first device: the pipelined Mosaic-GPU update's CTA count."""
    return getattr(jax.devices()[0], "core_count", 132)


@functools.partial(jax.jit, static_argnames=("ctas", "bf16_sums", "one_launch"), donate_argnums=(0, 1))
def decode_step_mgpu(conv_state, state, *rest, ctas=None, bf16_sums="wgmma", one_launch=True):
    """One decode step through :func:`pallas_kernels.kda.decode_mgpu.fused_recurrent_kda_mgpu` (one Mosaic-GPU
    launch, or with ``one_launch`` False the state update after a Triton kernel for conv, norms and gate; ``ctas``:
    the update's pipelined form over that many CTAs; ``bf16_sums``: a bf16 pool's column sums), returning what
    :func:`decode_step` does."""
    x = dict(zip(REST_ORDER, rest))
    per_token = {name: x[name][:, None] for name in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits")}
    y, conv_state, state = fused_recurrent_kda_mgpu(
        conv_weight=x["conv_weight"], conv_state=conv_state, A_log=x["A_log"], dt_bias=x["dt_bias"], state=state,
        slots=x["slots"], out_slots=x["slots"][:, None], o_norm_weight=x["o_norm_weight"], lower_bound=LOWER_BOUND,
        ctas=ctas, bf16_sums=bf16_sums, one_launch=one_launch, **per_token)
    return y[:, 0], conv_state, state


class DecodeCase:
    def __init__(self, batch, heads, state_dtype, check, key):
        self.batch, self.heads, self.check = batch, heads, check
        self.x = decode_inputs(key, batch, heads, state_dtype)
        self.rest = [self.x[a] for a in REST_ORDER]
        state_bytes = 2 * batch * heads * HEAD_DIM * HEAD_DIM * jnp.dtype(state_dtype).itemsize
        self.row = dict(kind="decode", B=batch, H=heads, state_dtype=jnp.dtype(state_dtype).name,
                        state_bytes=state_bytes)
        self.name = f"decode H{heads} B{batch} {self.row['state_dtype']}"

    def pools(self):
        return [jnp.copy(self.x["conv_state"]), jnp.copy(self.x["state"])]

    def compile(self, impl):
        start = time.perf_counter()
        out = jax.block_until_ready(decode_step(*self.pools(), *self.rest, impl=impl))
        self.row[f"{'ours' if impl == 'pallas' else 'xla_ref'}_first_call_s"] = time.perf_counter() - start
        if self.check and impl == "reference":
            y, cs, st = decode_step(*self.pools(), *self.rest, impl="pallas")
            y_r, cs_r, st_r = out
            row = self.row
            row["err_vs_ref_y"], row["err_vs_ref_state"] = rel_err(y, y_r), rel_err(st, st_r)
            row["err_vs_ref_conv"] = rel_err(cs, cs_r)
            y, cs, st = decode_step(*self.pools(), *self.rest, impl="pallas", split_v=DECODE_SPLIT_V[0])
            row["split_v_err_vs_ref"] = max(rel_err(y, y_r), rel_err(st, st_r), rel_err(cs, cs_r))
            y, cs, st = decode_step_mgpu(*self.pools(), *self.rest)
            row["mgpu_err_vs_ref"] = max(rel_err(y, y_r), rel_err(st, st_r), rel_err(cs, cs_r))
            y, cs, st = decode_step_mgpu(*self.pools(), *self.rest, one_launch=False)
            row["mgpu3_err_vs_ref"] = max(rel_err(y, y_r), rel_err(st, st_r), rel_err(cs, cs_r))
            y, cs, st = decode_step_mgpu(*self.pools(), *self.rest, ctas=num_sms())
            row["mgpu_pipe_err_vs_ref"] = max(rel_err(y, y_r), rel_err(st, st_r), rel_err(cs, cs_r))
            if row["state_dtype"] == "bfloat16":
                for launch, one_launch in (("mgpu", True), ("mgpu3", False)):
                    y, cs, st = decode_step_mgpu(*self.pools(), *self.rest, bf16_sums="reduce", one_launch=one_launch)
                    row[f"{launch}_reduce_err_vs_ref"] = max(rel_err(y, y_r), rel_err(st, st_r), rel_err(cs, cs_r))
            print(f"check {self.name}: rel err y {row['err_vs_ref_y']:.1e} state {row['err_vs_ref_state']:.1e} "
                  f"conv {row['err_vs_ref_conv']:.1e}", flush=True)

    def time(self, impl, sliced: bool = True):
        """Wall (and for ours, profiler device) time of each variant: the tuned kernel, the Mosaic-GPU step in one
        launch (``ours_mgpu``) and in three (``ours_mgpu3``, with the state update's own time), pipelined, each
        launch form with a bf16 pool's column sums by reductions (``_reduce``), and with ``sliced`` the V-slice
        and split-V kernels."""
        step = functools.partial(decode_step, impl=impl)
        if impl != "pallas":
            variants = [("xla_ref_s", step)]
        else:
            variants = [("ours_s", step), ("ours_mgpu_s", decode_step_mgpu),
                        ("ours_mgpu3_s", functools.partial(decode_step_mgpu, one_launch=False)),
                        ("ours_mgpu_pipe_s", functools.partial(decode_step_mgpu, ctas=num_sms()))]
            if self.row["state_dtype"] == "bfloat16":  # the column sums by reductions (more CTAs per SM)
                variants += [("ours_mgpu_reduce_s", functools.partial(decode_step_mgpu, bf16_sums="reduce")),
                             ("ours_mgpu3_reduce_s", functools.partial(decode_step_mgpu, bf16_sums="reduce",
                                                                       one_launch=False))]
        if impl == "pallas" and sliced:
            variants += [(f"ours_bv{bv}_s", functools.partial(step, block_v=bv)) for bv in DECODE_BLOCK_V]
            variants += [(f"ours_split{sv}_s", functools.partial(step, split_v=sv)) for sv in DECODE_SPLIT_V]
        for label, fn in variants:
            pools = self.pools()

            def run():
                pools[:] = fn(*pools, *self.rest)[1:]
                return pools[1]

            self.row[label] = time_jax(run, iters=50 if impl == "pallas" else 10)
            device = ""
            if impl == "pallas":  # the kernels' profiler time: batch 1 is dispatch-bound in wall-clock time
                split = kernel_split_us(run, (), 10)
                self.row[f"{label[:-2]}_device_us"] = sum(split.values())
                device = f", device {self.row[f'{label[:-2]}_device_us']:.1f} us"
                if label.startswith("ours_mgpu"):  # every kernel's time: the update's name is Mosaic-GPU's choice
                    self.row[f"{label[:-2]}_split_us"] = split
                    own = [us for name, us in split.items() if "mosaic" in name.lower()]  # anonymous_mosaic_gpu_kernel
                    if own:
                        self.row[f"{label[:-2]}_kernel_us"] = own[0]
                        device += f" (state update {own[0]:.1f} us)"
            print(f"{self.name}: {impl} {label} {self.row[label] * 1e6:.1f} us{device}", flush=True)

    def time_fla(self):
        import torch
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

        batch, heads, x = self.batch, self.heads, self.x
        tq = torch.randn(batch, 1, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        tk, tv = torch.randn_like(tq), torch.randn_like(tq)
        tg = torch.randn_like(tq)
        tb = torch.rand(batch, 1, heads, device="cuda", dtype=torch.bfloat16)
        h0 = to_torch(x["state"])[1:].contiguous()
        kw = dict(A_log=to_torch(x["A_log"]), dt_bias=to_torch(x["dt_bias"]), initial_state=h0,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  lower_bound=LOWER_BOUND)
        with torch.inference_mode():
            self.row["fla_s"] = time_torch(lambda: fla_fused_recurrent_kda(tq, tk, tv, tg, tb, **kw))
        print(f"{self.name}: fla {self.row['fla_s'] * 1e6:.1f} us", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# FLA autotune warm-up (child process)


def fla_warmup(heads, decode):
    """Compile every autotune config of FLA's chunk_kda at this head count (and its fused_recurrent_kda for the
    decode head counts) into Triton's on-disk kernel cache: each config is launched once and given the same fake
    time, and (FLA_CACHE_RESULTS=0, set by the parent) no autotune result is stored. The parent's own autotuning
    then finds every binary compiled and only benchmarks."""
    import torch
    from triton.runtime import autotuner

    def one_launch(kernel_call, quantiles=None, **_):
        kernel_call()
        torch.cuda.synchronize()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    autotuner.Autotuner.do_bench = property(lambda self: one_launch)
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    dev, bf16 = "cuda", torch.bfloat16
    total = 1024
    q = torch.randn(1, total, heads, HEAD_DIM, device=dev, dtype=bf16)
    k, v, g = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    beta = torch.rand(1, total, heads, device=dev, dtype=bf16)
    A_log = torch.rand(heads, device=dev, dtype=torch.float32)
    dt_bias = torch.randn(heads * HEAD_DIM, device=dev, dtype=torch.float32)
    cu = torch.tensor([0, total], device=dev, dtype=torch.long)
    gates = [dict(safe_gate=True, lower_bound=LOWER_BOUND)] + ([{}] if heads == 32 else [])
    with torch.inference_mode():
        for gate in gates:
            start = time.perf_counter()
            fla_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                          dt_bias=dt_bias, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), **gate)
            torch.cuda.synchronize()
            print(f"warm-up chunk_kda H{heads} {gate}: {time.perf_counter() - start:.1f} s", flush=True)
        if decode:
            for dtype in (torch.float32, bf16):
                start = time.perf_counter()
                h0 = torch.randn(1, heads, HEAD_DIM, HEAD_DIM, device=dev, dtype=torch.float32).to(dtype)
                fla_fused_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], A_log=A_log,
                                        dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        lower_bound=LOWER_BOUND)
                torch.cuda.synchronize()
                print(f"warm-up fused_recurrent_kda H{heads} {dtype}: {time.perf_counter() - start:.1f} s", flush=True)


def spawn_warmups(head_counts, decode_heads, out_dir):
    env = dict(os.environ, FLA_CACHE_RESULTS="0", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    children = []
    for h in head_counts:
        log = open(os.path.join(out_dir, f"fla_warmup_H{h}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--fla-warmup", str(h)]
        if h in decode_heads:
            cmd.append("--fla-warmup-decode")
        children.append((h, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    return children


def wait_warmups(children, deadline_s):
    """Wait for the children until ``deadline_s`` (seconds since start); stop any still running then."""
    status = {}
    for h, proc in children:
        try:
            proc.wait(timeout=max(1.0, deadline_s - elapsed()))
            status[h] = f"done rc={proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by handle
            proc.wait()
            status[h] = "stopped at deadline"
    print(f"FLA warm-up children: {status} at {elapsed():.0f} s", flush=True)
    return status


# ----------------------------------------------------------------------------------------------------------------


def _errors(row) -> str:
    """The table-line suffix naming a row's failures, if any."""
    return ((f"  ERROR {row['error'][:100]}" if "error" in row else "")
            + (f"  FLA ERROR {row['fla_error'][:100]}" if "fla_error" in row else ""))


def _best_split_device_us(row) -> float:
    """The fastest split-V variant's profiler time in a decode row (NaN if none was timed)."""
    return min((v for k, v in row.items() if k.startswith("ours_split") and k.endswith("_device_us")),
               default=float("nan"))


def print_table(ceilings, rows):
    bw, mm = ceilings.get("copy_bytes_per_s", float("nan")), ceilings.get("bf16_matmul_flops", float("nan"))
    nan = float("nan")
    print(f"\ndevice: {jax.devices()[0].device_kind}; copy {bw / 1e12:.2f} TB/s; bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print(f"{'prefill':<24}{'ours ms':>9}{'fla ms':>9}{'xla ms':>9}{'x fla':>7}{'Mtok/s':>8}{'TFLOP/s':>9}{'%mm':>5}"
          f"{'TB/s':>6}{'%BW':>5}{'fla TF/s':>9}{'err_fla':>9}{'err_ref':>9}")
    for r in rows:
        if r["kind"] != "prefill":
            continue
        ours, fla, xla = r.get("ours_s", nan), r.get("fla_s", nan), r.get("xla_ref_s", nan)
        print(f"{r['name']:<24}{ours * 1e3:9.3f}{fla * 1e3:9.3f}{xla * 1e3:9.2f}{fla / ours:7.2f}"
              f"{r['tokens'] / ours / 1e6:8.2f}{r['flops'] / ours / 1e12:9.1f}{100 * r['flops'] / ours / mm:5.1f}"
              f"{r['bytes'] / ours / 1e12:6.2f}{100 * r['bytes'] / ours / bw:5.0f}{r['flops'] / fla / 1e12:9.1f}"
              f"{r.get('err_vs_fla_o', nan):9.1e}{r.get('err_vs_ref_o', nan):9.1e}"
              + _errors(r))
    print(f"{'decode':<24}{'ours us':>9}{'fla us':>9}{'xla us':>9}{'x fla':>7}{'Ktok/s':>8}{'TB/s':>8}{'%copy':>7}"
          f"{'fla TB/s':>9}{'fla %':>7}{'err_ref':>9}{'dev us':>8}{'split dev':>10}{'mgpu dev':>9}{'%copy':>6}"
          f"{'3-launch':>9}{'kern':>7}{'%copy':>6}{'pipe dev':>9}{'reduce':>8}{'%copy':>6}")
    for r in rows:
        if r["kind"] != "decode":
            continue
        name = f"H{r['H']} B{r['B']} {r['state_dtype']}"
        pct = lambda key: 100 * r["state_bytes"] / (r.get(key, nan) * 1e-6) / bw  # noqa: B023 (used at once)
        ours, fla, xla = r.get("ours_s", nan), r.get("fla_s", nan), r.get("xla_ref_s", nan)
        print(f"{name:<24}{ours * 1e6:9.1f}{fla * 1e6:9.1f}{xla * 1e6:9.1f}{fla / ours:7.2f}{r['B'] / ours / 1e3:8.1f}"
              f"{r['state_bytes'] / ours / 1e12:8.2f}{100 * r['state_bytes'] / ours / bw:7.0f}"
              f"{r['state_bytes'] / fla / 1e12:9.2f}{100 * r['state_bytes'] / fla / bw:7.0f}"
              f"{r.get('err_vs_ref_y', nan):9.1e}{r.get('ours_device_us', nan):8.1f}{_best_split_device_us(r):10.1f}"
              f"{r.get('ours_mgpu_device_us', nan):9.1f}{pct('ours_mgpu_device_us'):6.0f}"
              f"{r.get('ours_mgpu3_device_us', nan):9.1f}{r.get('ours_mgpu3_kernel_us', nan):7.1f}"
              f"{pct('ours_mgpu3_kernel_us'):6.0f}{r.get('ours_mgpu_pipe_device_us', nan):9.1f}"
              f"{r.get('ours_mgpu_reduce_device_us', nan):8.1f}{pct('ours_mgpu_reduce_device_us'):6.0f}"
              + _errors(r))


def suggest_decode_routing(rows) -> dict:
    """``KDADecodeConfig``'s Mosaic-GPU fields from the decode rows' profiler times (``--suite decode-mgpu``): the
    one-launch step where it beat the three launches in most cases, a bf16 pool's reductions where they beat its
    ``wgmma`` in most, then per pool dtype the fewest (sequence, value head) rows from which the chosen form beat
    the tuned Triton kernel in every timed case (0: in none, or not timed). Rows lacking a time do not vote."""
    decode = [r for r in rows if r.get("kind") == "decode"]

    def wins(rows_, fast, slow):
        pairs = [(r[fast], r[slow]) for r in rows_ if fast in r and slow in r]
        return bool(pairs) and 2 * sum(a < b for a, b in pairs) > len(pairs)

    one_launch = wins(decode, "ours_mgpu_device_us", "ours_mgpu3_device_us")
    launch = "mgpu" if one_launch else "mgpu3"
    bf16 = [r for r in decode if r["state_dtype"] == "bfloat16"]
    reduce = wins(bf16, f"ours_{launch}_reduce_device_us", f"ours_{launch}_device_us")

    def threshold(dtype, form):
        cases = sorted((r["B"] * r["H"], r[form] < r["ours_device_us"]) for r in decode
                       if r["state_dtype"] == dtype and form in r and "ours_device_us" in r)
        for i, (n, _) in enumerate(cases):
            if all(win for _, win in cases[i:]):
                return n
        return 0

    bf16_form = f"ours_{launch}_reduce_device_us" if reduce else f"ours_{launch}_device_us"
    return dict(mgpu_min_rows=threshold("float32", f"ours_{launch}_device_us"),
                mgpu_min_rows_bf16=threshold("bfloat16", bf16_form),
                mgpu_one_launch=one_launch, mgpu_bf16_sums="reduce" if reduce else "wgmma")


def suite_cases(suite, rng):
    """(prefill [(name, lengths, H, HV, lower_bound, with_reference)], decode [(B, H, state dtype, check)])."""
    if suite == "tiny":  # CPU smoke test of the script itself (interpret mode)
        return [("tiny", [100, 28], 2, 2, LOWER_BOUND, True)], [(2, 2, jnp.float32, True)]
    if suite == "decode-check":
        return [], [(16, 32, jnp.float32, True), (16, 32, jnp.bfloat16, True)]
    if suite == "decode":  # every decode case of the full suite, no prefill
        return [], decode_cases()
    if suite == "decode-mgpu":  # the tuned kernel against the Mosaic-GPU decode, B >= 16 (B16 last: a deadline cuts it)
        return [], [(b, h, dt, b == 64) for b in (64, 256, 16) for h in (32, 96) for dt in (jnp.float32, jnp.bfloat16)]
    if suite == "smoke":
        return ([("H32 T8K", [8192], 32, 32, LOWER_BOUND, False)],
                [(64, 32, jnp.float32, False), (64, 96, jnp.float32, False)])
    if suite == "quick":
        return ([("H32 T8K", [8192], 32, 32, LOWER_BOUND, True),
                 ("H32 T8K softplus", [8192], 32, 32, None, False),  # Kimi-Linear's gate: dyadic diagonal
                 ("varlen8 H12 1-4K", list(rng.integers(1024, 4097, 8)), 12, 12, LOWER_BOUND, False)],
                [(64, 32, jnp.float32, True), (64, 32, jnp.bfloat16, False), (1, 32, jnp.float32, False)])
    # full: the XLA reference everywhere but H=96 T=32K (its compile + run would not fit the call's budget)
    prefill = [(f"H{h} T{t // 1024}K", [t], h, h, LOWER_BOUND, not (h == 96 and t == 32768))
               for h in (12, 32, 96) for t in (1024, 8192, 32768)]
    prefill += [("H32 T8K softplus", [8192], 32, 32, None, True),
                ("varlen8 H32 1-4K", list(rng.integers(1024, 4097, 8)), 32, 32, LOWER_BOUND, True)]
    return prefill, decode_cases()


def decode_cases():
    """The full grid of decode cases: H in {12, 32, 96} x batch {1, 16, 64, 256} x fp32 / bf16 state pool, checked
    against the reference at batch 16."""
    return [(b, h, dt, b == 16) for h in (12, 32, 96) for b in (1, 16, 64, 256) for dt in (jnp.float32, jnp.bfloat16)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=("tiny", "decode-check", "decode", "decode-mgpu", "smoke", "quick", "full"),
                        default="full")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention (its autotuning is slow)")
    parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--no-warmup", action="store_true", help="no parallel FLA compile warm-up children")
    parser.add_argument("--warmup-deadline-s", type=float, default=300.0,
                        help="stop the FLA warm-up children at this many seconds from the start")
    parser.add_argument("--ref-compile-deadline-s", type=float, default=240.0,
                        help="compile XLA references in phase 2 only until this many seconds from the start")
    parser.add_argument("--deadline-s", type=float, default=500.0,
                        help="after this many seconds skip the XLA reference work still left")
    parser.add_argument("--fla-warmup", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fla-warmup-decode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns per lowering
    if args.fla_warmup is not None:
        fla_warmup(args.fla_warmup, args.fla_warmup_decode)
        return
    os.makedirs(args.out, exist_ok=True)
    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    report = dict(ceilings={}, checks={}, rows=[], device=jax.devices()[0].device_kind, suite=args.suite,
                  skipped=[], phases={})

    def save():
        report["elapsed_s"] = elapsed()
        with open(os.path.join(args.out, "kda_bench.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    def guarded(row, what, fn, error_key="error"):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
            traceback.print_exc()
            row[error_key] = f"{what}: {e!r}"[:500]
        save()

    # Phase 1: ceilings, on a quiet GPU.
    if not args.no_ceilings:
        try:
            report["ceilings"] = device_ceilings()
            c = report["ceilings"]
            print(f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {c['bf16_matmul_flops'] / 1e12:.0f} "
                  f"TFLOP/s", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    report["phases"]["ceilings_done_s"] = elapsed()
    save()

    prefill_specs, decode_specs = suite_cases(args.suite, rng)
    with_fla = not args.no_fla
    children = []
    if with_fla and not args.no_warmup:
        heads = sorted({h for _, _, h, _, _, _ in prefill_specs} | {h for _, h, _, _ in decode_specs})
        children = spawn_warmups(heads, {h for _, h, _, _ in decode_specs}, args.out)

    # Phase 2: compile ours (and the references) and check correctness; nothing timed while children run.
    prefill, decode = [], []
    for name, lengths, h, hv, lb, with_ref in prefill_specs:
        key, sub = jax.random.split(key)
        case = PrefillCase(name, lengths, h, hv, lb, with_ref and not args.no_ref, sub)
        prefill.append(case)
        report["rows"].append(case.row)
        guarded(case.row, "ours compile", lambda: case.compile("pallas"))
        print(f"{name}: ours first call {case.row.get('ours_first_call_s', float('nan')):.1f} s at {elapsed():.0f} s",
              flush=True)
    for batch, h, dt, check in decode_specs:
        key, sub = jax.random.split(key)
        case = DecodeCase(batch, h, dt, check, sub)
        decode.append(case)
        report["rows"].append(case.row)
        guarded(case.row, "ours compile", lambda: case.compile("pallas"))
    print(f"ours compiled at {elapsed():.0f} s", flush=True)
    failures = []
    if not args.no_checks:
        failures = run_checks(report, correctness_checks, key)
        save()
    if not args.no_ref:
        for case in decode:
            guarded(case.row, "xla reference compile", lambda: case.compile("reference"))
        for case in prefill:
            if case.with_reference and elapsed() < args.ref_compile_deadline_s:
                guarded(case.row, "xla reference compile", lambda: case.compile("reference"))
                print(f"{case.row['name']}: xla reference first call {case.row.get('xla_ref_first_call_s', 0):.1f} s "
                      f"at {elapsed():.0f} s", flush=True)
    report["phases"]["compile_done_s"] = elapsed()
    if children:
        report["fla_warmup"] = wait_warmups(children, args.warmup_deadline_s)
    report["phases"]["warmup_done_s"] = elapsed()
    save()

    # Phase 3: timings with the GPU to ourselves: ours, then FLA (decode first: no autotuning; then prefill,
    # H=32 first), then the XLA references.
    for case in prefill:
        if "ours_first_call_s" in case.row:
            guarded(case.row, "ours", case.time_ours)
    for case in decode:
        if "ours_first_call_s" in case.row:
            guarded(case.row, "ours", lambda: case.time("pallas", sliced=args.suite != "decode-mgpu"))
    report["phases"]["ours_done_s"] = elapsed()
    if with_fla:
        for case in decode:
            guarded(case.row, "fla", case.time_fla, error_key="fla_error")
        for case in sorted(prefill, key=lambda c: {32: 0, 96: 1}.get(c.heads, 2)):
            guarded(case.row, "fla", case.time_fla, error_key="fla_error")
    report["phases"]["fla_done_s"] = elapsed()
    if not args.no_ref:
        for case in decode:
            if "xla_ref_first_call_s" in case.row and elapsed() < args.deadline_s:
                guarded(case.row, "xla reference", lambda: case.time("reference"))
        for case in prefill:
            if not case.with_reference:
                continue
            if elapsed() > args.deadline_s:
                report["skipped"].append(f"xla reference {case.row['name']}")
                continue
            if "xla_ref_first_call_s" not in case.row:
                guarded(case.row, "xla reference compile", lambda: case.compile("reference"))
            if "xla_ref_first_call_s" in case.row:
                guarded(case.row, "xla reference", case.time_reference)
    report["phases"]["done_s"] = elapsed()
    save()
    print_table(report["ceilings"], report["rows"])
    if args.suite == "decode-mgpu":
        report["suggested_routing"] = suggest_decode_routing(report["rows"])
        save()
        print(f"suggested KDADecodeConfig for {report['device']}: {json.dumps(report['suggested_routing'])}")
    print("skipped:", report["skipped"], f"total {elapsed():.0f} s", flush=True)
    if not args.no_checks:
        report["check_failures"] = failures + row_failures(report)
        save()
        bench_checks.finish("kda bench", report["check_failures"])


if __name__ == "__main__":
    main()
