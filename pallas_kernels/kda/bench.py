"""H200 benchmark of the KDA kernels: ours (Pallas) vs flash-linear-attention 0.6.0 vs our XLA reference.

One run measures the device ceilings (device-to-device copy bandwidth, bf16 8192^3 matmul rate), checks the
Pallas kernels against the references on fresh random inputs, then times prefill (bf16 inputs, K = V = 128,
in-kernel q/k L2 norm and gate) and decode (one token per sequence, fp32 or bf16 state pool) on the same
inputs for every implementation. Needs torch + FLA wheels (``bash ../shared/tools/peer-wheels.sh``).

Usage (repo root, GPU machine): ``PYTHONPATH=. python3 pallas_kernels/kda/bench.py [--suite quick|full]``.
Writes ``kda_bench.json`` under ``$OUT`` (or the cwd) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch in the same process

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

CHUNK = 64
HEAD_DIM = 128
LOWER_BOUND = -5.0
CONV_WIDTH = 4


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
    return {"copy_bytes_per_s": 2 * 2**31 / copy_s, "bf16_matmul_flops": 2 * 8192**3 / mm_s}


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
        print(f"check prefill {name}: rel err o {errs[0]:.1e} final {errs[1]:.1e} checkpoints {errs[2]:.1e}")
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


def run_prefill(name, lengths, heads, value_heads, lower_bound, with_reference, with_fla, rows, key):
    x = prefill_inputs(key, lengths, heads, value_heads)
    gate = dict(use_qk_l2norm=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound)

    def ours_fn(impl):
        return jax.jit(lambda q, k, v, g, beta, cu: chunk_kda(q, k, v, g, beta, cu_seqlens=cu, impl=impl, **gate)[:2])

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"])
    row = dict(kind="prefill", name=name, H=heads, HV=value_heads, tokens=int(sum(lengths)), seqs=len(lengths),
               gate="lower_bound" if lower_bound is not None else "softplus",
               flops=prefill_flops(lengths, value_heads), bytes=prefill_bytes(lengths, heads, value_heads))
    ours = ours_fn("pallas")
    start = time.perf_counter()
    o, state = jax.block_until_ready(ours(*args))
    row["ours_compile_s"] = time.perf_counter() - start
    row["ours_s"] = time_jax(ours, *args)
    print(f"{name}: ours {row['ours_s'] * 1e3:.3f} ms (first call {row['ours_compile_s']:.1f} s)", flush=True)
    if with_reference:
        ref = ours_fn("reference")
        row["xla_ref_s"] = time_jax(ref, *args, iters=2, repeats=3)
        o_ref, state_ref = ref(*args)
        row["err_vs_ref_o"], row["err_vs_ref_state"] = rel_err(o, o_ref), rel_err(state, state_ref)
    if not with_fla:
        rows.append(row)
        return
    try:
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        t = {n: to_torch(x[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
        cu = to_torch(x["cu_seqlens"]).long()
        fla_kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"],
                      output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        if lower_bound is not None:
            fla_kw.update(safe_gate=True, lower_bound=lower_bound)
        with torch.inference_mode():
            fla = lambda: fla_chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **fla_kw)
            o_fla, state_fla = fla()
            row["fla_s"] = time_torch(fla)
        row["err_vs_fla_o"] = rel_err(o, o_fla.float().cpu().numpy())
        row["err_vs_fla_state"] = rel_err(state, state_fla.float().cpu().numpy())
    except Exception as e:  # noqa: BLE001 - record the peer's failure, keep measuring ours
        row["fla_error"] = repr(e)[:300]
    rows.append(row)


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


def run_decode(batch, heads, state_dtype, check, with_reference, with_fla, rows, key):
    x = decode_inputs(key, batch, heads, state_dtype)
    state_bytes = 2 * batch * heads * HEAD_DIM * HEAD_DIM * jnp.dtype(state_dtype).itemsize
    row = dict(kind="decode", B=batch, H=heads, state_dtype=jnp.dtype(state_dtype).name, state_bytes=state_bytes)

    def step_fn(impl):
        def step(conv_state, state, *rest):
            args = dict(zip([a for a in ARG_ORDER if a not in ("conv_state", "state")], rest))
            return fused_recurrent_kda(conv_state=conv_state, state=state, lower_bound=LOWER_BOUND, impl=impl,
                                       **args)
        return jax.jit(step, donate_argnums=(0, 1))

    rest = [x[a] for a in ARG_ORDER if a not in ("conv_state", "state")]
    impls = (("pallas", "ours_s", 50), ("reference", "xla_ref_s", 10))[:2 if with_reference else 1]
    for impl, label, iters in impls:
        fn = step_fn(impl)
        pools = [jnp.copy(x["conv_state"]), jnp.copy(x["state"])]
        if check and impl == "pallas":
            y, cs, st = fn(*pools, *rest)
            y_r, cs_r, st_r = step_fn("reference")(jnp.copy(x["conv_state"]), jnp.copy(x["state"]), *rest)
            row["err_vs_ref_y"], row["err_vs_ref_state"] = rel_err(y, y_r), rel_err(st, st_r)
            row["err_vs_ref_conv"] = rel_err(cs, cs_r)
            print(f"check decode H{heads} B{batch} {row['state_dtype']}: rel err y {row['err_vs_ref_y']:.1e} "
                  f"state {row['err_vs_ref_state']:.1e} conv {row['err_vs_ref_conv']:.1e}", flush=True)
            pools = [cs, st]

        def run(pools=pools, fn=fn):
            pools[:] = fn(*pools, *rest)[1:]
            return pools[1]

        row[label] = time_jax(run, iters=iters)
        print(f"decode H{heads} B{batch} {row['state_dtype']}: {impl} {row[label] * 1e6:.1f} us", flush=True)
    if not with_fla:
        rows.append(row)
        return
    try:
        import torch
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

        tq = torch.randn(batch, 1, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        tk, tv = torch.randn_like(tq), torch.randn_like(tq)
        tg = torch.randn_like(tq)
        tb = torch.rand(batch, 1, heads, device="cuda", dtype=torch.bfloat16)
        h0 = to_torch(x["state"])[1:].contiguous()
        kw = dict(A_log=to_torch(x["A_log"]), dt_bias=to_torch(x["dt_bias"]), initial_state=h0,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  lower_bound=LOWER_BOUND)
        with torch.inference_mode():
            row["fla_s"] = time_torch(lambda: fla_fused_recurrent_kda(tq, tk, tv, tg, tb, **kw))
    except Exception as e:  # noqa: BLE001
        row["fla_error"] = repr(e)[:300]
    rows.append(row)


# ----------------------------------------------------------------------------------------------------------------


def print_table(ceilings, rows):
    bw, mm = ceilings.get("copy_bytes_per_s", float("nan")), ceilings.get("bf16_matmul_flops", float("nan"))
    print(f"\ndevice: {jax.devices()[0].device_kind}; copy {bw / 1e12:.2f} TB/s; bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print(f"{'prefill':<26}{'ours ms':>9}{'fla ms':>9}{'xla ms':>9}{'x fla':>7}{'Mtok/s':>8}{'TFLOP/s':>9}"
          f"{'TB/s':>6}{'err_fla':>9}{'err_ref':>9}")
    for r in rows:
        if r["kind"] != "prefill":
            continue
        if "error" in r:
            print(f"{r['name']:<26} ERROR {r['error'][:120]}")
            continue
        ours, fla, xla = r.get("ours_s", float("nan")), r.get("fla_s", float("nan")), r.get("xla_ref_s", float("nan"))
        print(f"{r['name']:<26}{ours * 1e3:9.3f}{fla * 1e3:9.3f}{xla * 1e3:9.2f}{fla / ours:7.2f}"
              f"{r['tokens'] / ours / 1e6:8.2f}{r['flops'] / ours / 1e12:9.1f}{r['bytes'] / ours / 1e12:6.2f}"
              f"{r.get('err_vs_fla_o', float('nan')):9.1e}{r.get('err_vs_ref_o', float('nan')):9.1e}")
    print(f"{'decode':<26}{'ours us':>9}{'fla us':>9}{'xla us':>9}{'x fla':>7}{'TB/s':>8}{'%copy':>7}{'fla TB/s':>9}"
          f"{'err_ref':>9}")
    for r in rows:
        if r["kind"] != "decode":
            continue
        name = f"H{r['H']} B{r['B']} {r['state_dtype']}"
        if "error" in r:
            print(f"{name:<26} ERROR {r['error'][:120]}")
            continue
        ours, fla, xla = r.get("ours_s", float("nan")), r.get("fla_s", float("nan")), r.get("xla_ref_s", float("nan"))
        print(f"{name:<26}{ours * 1e6:9.1f}{fla * 1e6:9.1f}{xla * 1e6:9.1f}{fla / ours:7.2f}"
              f"{r['state_bytes'] / ours / 1e12:8.2f}{100 * r['state_bytes'] / ours / bw:7.0f}"
              f"{r['state_bytes'] / fla / 1e12:9.2f}{r.get('err_vs_ref_y', float('nan')):9.1e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=("decode-check", "smoke", "quick", "full"), default="full")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention (its autotuning is slow)")
    parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns per lowering
    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    ceilings, rows, checks = {}, [], {}
    try:
        ceilings = {} if args.no_ceilings else device_ceilings()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if not args.no_checks:
        try:
            checks = correctness_checks(key)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if args.suite == "decode-check":
        prefill = []
        decode = [(16, 32, jnp.float32, True), (16, 32, jnp.bfloat16, True)]
    elif args.suite == "smoke":
        prefill = [("H32 T8K", [8192], 32, 32, LOWER_BOUND, False)]
        decode = [(64, 32, jnp.float32, False), (64, 96, jnp.float32, False)]
    elif args.suite == "quick":
        prefill = [("H32 T8K", [8192], 32, 32, LOWER_BOUND, True),
                   ("varlen8 H12 1-4K", list(rng.integers(1024, 4097, 8)), 12, 12, LOWER_BOUND, False)]
        decode = [(64, 32, jnp.float32, True), (64, 32, jnp.bfloat16, False)]
    else:
        prefill = [(f"H{h} T{t // 1024}K", [t], h, h, LOWER_BOUND, t <= 8192 and h <= 32)
                   for h in (12, 32, 96) for t in (1024, 8192, 32768)]
        prefill += [("H32 T8K softplus", [8192], 32, 32, None, False),
                    ("varlen8 H32 1-4K", list(rng.integers(1024, 4097, 8)), 32, 32, LOWER_BOUND, False)]
        decode = [(b, h, dt, b == 16) for h in (32, 96) for b in (1, 16, 64, 256) for dt in (jnp.float32, jnp.bfloat16)]
    for name, lengths, h, hv, lb, with_ref in prefill:
        key, sub = jax.random.split(key)
        try:
            run_prefill(name, [int(n) for n in lengths], h, hv, lb, with_ref and not args.no_ref, not args.no_fla,
                        rows, sub)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(kind="prefill", name=name, error=repr(e)[:500]))
    for batch, h, dt, check in decode:
        key, sub = jax.random.split(key)
        try:
            run_decode(batch, h, dt, check, not args.no_ref, not args.no_fla, rows, sub)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(kind="decode", B=batch, H=h, state_dtype=jnp.dtype(dt).name, error=repr(e)[:500]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kda_bench.json"), "w") as f:
        json.dump(dict(ceilings=ceilings, checks=checks, rows=rows, device=jax.devices()[0].device_kind), f, indent=1, default=str)
    print_table(ceilings, rows)


if __name__ == "__main__":
    main()
