"""Device memory of the compiled step executables: temporaries per bucket, the largest buffers of an optimised
HLO module, and the start-up check that the step's temporaries fit beside the weights and cache pools."""

from __future__ import annotations

import re

GIB = 1 << 30
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ALIASES = ("parameter", "bitcast", "get-tuple-element")  # views of another buffer, not allocations
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")


def large_buffers(hlo_text: str, min_bytes: int, limit: int = 8) -> list[tuple[int, str, str]]:
    """Instructions of an optimised HLO module (``compiled.as_text()``) with an array result of at least
    ``min_bytes``: ``[(bytes, name, opcode)]``, largest first, at most ``limit``. Only the ENTRY computation is
    read (instructions inside fusions are not buffers); parameters, bitcasts and tuple elements (views
    of other buffers, e.g. the cache pools a step updates in place) are excluded."""
    found = []
    lines = hlo_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is not None:
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("}")), len(lines))
        lines = lines[start + 1:end]
    for line in lines:
        match = _INSTRUCTION.match(line)
        if not match or match.group(4) in _ALIASES or match.group(2) not in _DTYPE_BYTES:
            continue
        size = _DTYPE_BYTES[match.group(2)]
        for dim in filter(None, match.group(3).split(",")):
            size *= int(dim)
        if size >= min_bytes:
            found.append((size, match.group(1), match.group(4)))
    return sorted(found, reverse=True)[:limit]


def step_temp_bytes(compiled) -> int:
    """Bytes of temporaries one run of a compiled executable allocates (0 when the backend does not say)."""
    stats = compiled.memory_analysis()
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0


def check_step_memory(temps: dict, free_bytes: int, describe=lambda key: "") -> None:
    """Raise ValueError when the largest step temporaries (``temps``: bucket -> bytes) exceed ``free_bytes`` (device
    memory left after the weights and the cache pools): a step would otherwise fail with an out-of-memory error
    while serving. ``describe(key)`` adds detail on that executable (e.g. its largest buffers)."""
    if not temps:
        return
    key, need = max(temps.items(), key=lambda kv: kv[1])
    if need > free_bytes:
        raise ValueError(
            f"the compiled step for bucket {key} needs {need / GIB:.2f} GiB of temporaries but only "
            f"{free_bytes / GIB:.2f} GiB of device memory are free after the weights and cache pools; lower "
            f"max_num_batched_tokens or max_num_seqs, or raise activation_reserve_bytes (now part of the cache "
            f"budget){describe(key)}")
