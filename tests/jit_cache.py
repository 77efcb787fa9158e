"""The test suite's opt-in persistent XLA compilation cache (``KIMI_JAX_TEST_JIT_CACHE=<folder>``).

Off by default: XLA:CPU (jaxlib 0.11.2) now and then aborts the whole process inside ``executable.serialize()``
while writing a large training-step program to the cache, which takes a pytest worker down with it. A developer who
reruns the suite often can turn it on; CI runs without it."""

import os

FOLDER = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", "")


def subprocess_env() -> dict[str, str]:
    """Environment entries that give a child JAX process (and ``kimi-jax serve``) the same cache choice."""
    if not FOLDER:
        return {"KIMI_JAX_COMPILE_CACHE": "off"}
    return {"JAX_COMPILATION_CACHE_DIR": FOLDER, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
            "KIMI_JAX_COMPILE_CACHE": FOLDER}
