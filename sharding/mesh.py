"""Device meshes with the four named axes every partition rule refers to.

Axes (outermost first):
* ``data``   whole model replicas serving different requests.
* ``tensor`` tensor parallelism: projections split over heads / FFN width, vocabulary-parallel embeddings.
* ``expert`` expert parallelism: routed experts split over E (attention and caches replicated over it).
* ``dcp``    decode context parallelism: MLA pages split along blocks. As in vLLM, the DCP ranks are also
             tensor-parallel ranks for the weights, so weights split over ``tensor x dcp`` and the MLA cache
             is replicated only over ``tensor``.

The model forward carries no sharding annotations, so the mesh axes are ``AxisType.Auto`` by default and XLA's
GSPMD propagation partitions it from the parameter placements (``jax.make_mesh`` defaults to Explicit axes since
jax 0.9, which would require an ``out_sharding`` on every op with a sharded contracting dimension). Explicit
axes are available for code written against them (``jax.shard_map`` pieces).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "tensor", "expert", "dcp")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the four mesh axes (devices = their product)."""

    data: int = 1
    tensor: int = 1
    expert: int = 1
    dcp: int = 1
    expert_parallel: bool = False
    """vLLM's ``--enable-expert-parallel``: routed experts split over every rank of a replica (``tensor x dcp x
    expert``) instead of splitting each expert's FFN width over ``tensor x dcp`` (``sharding.rules.EP_ALL``)."""

    def __post_init__(self) -> None:
        bad = {a: s for a, s in self.sizes().items() if not (isinstance(s, int) and s >= 1)}
        if bad:
            raise ValueError(f"mesh axis sizes must be positive integers, got {bad}")

    def sizes(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def num_devices(self) -> int:
        return self.data * self.tensor * self.expert * self.dcp

    @property
    def tensor_parallel(self) -> int:
        """Ways each weight matrix is split: ``tensor x dcp``."""
        return self.tensor * self.dcp

    @property
    def replica_devices(self) -> int:
        """Devices of one data-parallel replica: ``tensor x expert x dcp``."""
        return self.tensor * self.expert * self.dcp

    @property
    def expert_shards(self) -> int:
        """Ranks the routed experts are split over (E / this experts per rank)."""
        return self.replica_devices if self.expert_parallel else self.expert

    def replica(self) -> "MeshShape":
        """The shape of one data-parallel replica (``data = 1``)."""
        return dataclasses.replace(self, data=1)

    def label(self) -> str:
        """Short name such as ``TP8 x DCP2`` (size-1 axes omitted; ``TP`` counts tensor x dcp ranks; ``TEP`` when
        the experts are split over them too, the recipe's name for ``--enable-expert-parallel``)."""
        tp = "TEP" if self.expert_parallel else "TP"
        parts = [f"DP{self.data}" if self.data > 1 else "", f"{tp}{self.tensor_parallel}",
                 f"EP{self.expert}" if self.expert > 1 else "", f"DCP{self.dcp}" if self.dcp > 1 else ""]
        return " x ".join(p for p in parts if p)

    @classmethod
    def of(cls, mesh: Mesh, *, expert_parallel: bool = False) -> "MeshShape":
        """The shape of a mesh made by :func:`make_mesh`."""
        missing = [a for a in AXES if a not in mesh.shape]
        if missing:
            raise ValueError(f"mesh lacks axes {missing}; make it with sharding.make_mesh")
        return cls(**{a: int(mesh.shape[a]) for a in AXES}, expert_parallel=expert_parallel)


def make_mesh(shape: MeshShape | None = None, *, devices=None, axis_type: AxisType = AxisType.Auto,
              **sizes: int) -> Mesh:
    """A mesh over ``shape.num_devices`` devices with axes ``("data", "tensor", "expert", "dcp")``.

    Args:
      shape: the axis sizes; or pass them as keywords (``make_mesh(tensor=4, expert=2)``).
      devices: devices to use (default: the first ``num_devices`` of ``jax.devices()``).
      axis_type: ``AxisType.Auto`` (GSPMD propagation, what the model forward needs) or ``AxisType.Explicit``.

    Raises ValueError when there are too few devices. On a CPU, fake devices come from
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` or ``jax.config.update("jax_num_cpu_devices", 8)``,
    set before JAX initialises its backend.
    """
    if shape is not None and sizes:
        raise ValueError("pass either a MeshShape or axis sizes as keywords, not both")
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {AXES}")
    shape = shape or MeshShape(**sizes)
    available = list(jax.devices() if devices is None else devices)
    if len(available) < shape.num_devices:
        raise ValueError(f"mesh {shape.sizes()} needs {shape.num_devices} devices, only {len(available)} available")
    return jax.make_mesh(tuple(shape.sizes().values()), AXES, axis_types=(axis_type,) * len(AXES),
                         devices=available[: shape.num_devices])
