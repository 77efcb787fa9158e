"""Step-executable memory report: HLO buffer parsing and the start-up temporaries check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from serve.engine.memory_report import (
    GIB,
    check_step_memory,
    large_buffers,
    step_temp_bytes,
)


def test_large_buffers_finds_the_big_results_of_a_compiled_module():
    compiled = jax.jit(lambda x: jnp.sort(x * 2, axis=0) + 1).lower(jnp.ones((256, 1024), jnp.float32)).compile()
    found = large_buffers(compiled.as_text(), min_bytes=256 * 1024 * 4)
    assert found, compiled.as_text()
    assert all(size >= 256 * 1024 * 4 for size, _, _ in found)
    assert [s for s, _, _ in found] == sorted((s for s, _, _ in found), reverse=True)
    assert not large_buffers(compiled.as_text(), min_bytes=1 << 40)


def test_large_buffers_parses_shapes_and_skips_parameters_views_and_fused_computations():
    text = """
%fused_computation (param_0: bf16[7168,163840]) -> f32[163840,1] {
  %convert.1 = f32[7168,163840]{1,0} convert(%param_0)
}

ENTRY %main (p: u8[3,896,3072,1792]) -> bf16[8,7168] {
  %p = u8[3,896,3072,1792]{3,2,1,0} parameter(0)
  %copy.1 = u8[2688,3072,1792]{2,1,0} copy(u8[2688,3072,1792]{2,1,0} %bitcast)
  ROOT %fusion = bf16[8,7168]{1,0} fusion(%copy.1), kind=kLoop
  %t = (f32[4], s32[2]) tuple(%a, %b)
  %bitcast.480.0 = u8[896,3,3072,1792]{3,2,1,0} bitcast(%p)
  %get-tuple-element.177 = u8[2688,3072,1792]{2,1,0} get-tuple-element(%w), index=0
}
"""
    assert large_buffers(text, min_bytes=1000) == [(2688 * 3072 * 1792, "copy.1", "copy"),
                                                   (8 * 7168 * 2, "fusion", "fusion")]


def test_step_temp_bytes_reads_the_memory_analysis():
    compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((64, 64))).compile()
    assert step_temp_bytes(compiled) >= 0


def test_check_step_memory_names_the_bucket_and_the_remedy():
    check_step_memory({(16, 8): 1 * GIB}, free_bytes=2 * GIB)
    check_step_memory({}, free_bytes=0)
    with pytest.raises(ValueError, match=r"bucket \(2048, 1\) needs 55.00 GiB .* 3.00 GiB .*max_num_batched_tokens"
                                         r".*copy.1"):
        check_step_memory({(16, 8): GIB, (2048, 1): 55 * GIB}, free_bytes=3 * GIB,
                          describe=lambda key: f"; largest buffers of {key}: copy.1")
