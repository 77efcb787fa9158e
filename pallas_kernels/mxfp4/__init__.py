"""W4A16 GEMMs over packed MXFP4 weights (dense and grouped by expert) and a bf16 grouped GEMM."""

from pallas_kernels.mxfp4.config import GroupedGemmConfig, GroupedGemmTiling, MXFP4MGPUConfig
from pallas_kernels.mxfp4.kernel import SHARED_EXPERT
from pallas_kernels.mxfp4.ops import (
                                      grouped_matmul,
                                      grouped_matmul_concat,
                                      mxfp4_grouped_matmul,
                                      mxfp4_grouped_matmul_concat,
                                      mxfp4_matmul,
)
from pallas_kernels.mxfp4.reference import (
                                      grouped_matmul_reference,
                                      mxfp4_grouped_matmul_reference,
                                      mxfp4_matmul_reference,
                                      rows_matmul_reference,
)

__all__ = ["GroupedGemmConfig", "GroupedGemmTiling", "MXFP4MGPUConfig", "SHARED_EXPERT", "grouped_matmul",
           "grouped_matmul_concat", "grouped_matmul_reference", "mxfp4_grouped_matmul", "mxfp4_grouped_matmul_concat",
           "mxfp4_grouped_matmul_reference", "mxfp4_matmul", "mxfp4_matmul_reference", "rows_matmul_reference"]
