"""AttnRes (Block Attention Residuals) depth mixing: ``attnres_mix`` with reference / Pallas implementations."""

from pallas_kernels.attnres.config import AttnResConfig
from pallas_kernels.attnres.ops import attnres_mix
from pallas_kernels.attnres.reference import attnres_mix_reference

__all__ = ["AttnResConfig", "attnres_mix", "attnres_mix_reference"]
