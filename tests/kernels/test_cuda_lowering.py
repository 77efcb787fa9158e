"""The decode step's Pallas kernels lower to Triton for CUDA on this CPU-only machine (``jax.export`` with
``platforms=["cuda"]``), at the Kimi-Linear-48B and K3 shapes the engine uses.

Interpret-mode tests check what a kernel computes, not that it lowers: a construct the Triton lowering rejects
would only show on the GPU. This runs the real Pallas -> Triton IR lowering (the step the GPU machine repeats
before compiling the IR to PTX), with the GPU description XLA would give for an H200, over the cases of
:mod:`pallas_kernels.lowering`."""

import pytest

from pallas_kernels.lowering import CASES, LAUNCHES, TRITON_CALL, cuda_lowering, export_for_cuda


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_lowers_to_triton_for_cuda(case):
    fn, args = CASES[case]
    with cuda_lowering():
        exported = export_for_cuda(fn, args)
    assert exported.mlir_module().count(TRITON_CALL) == LAUNCHES.get(case, 1)
