"""Shared by the benchmark scripts: the machine description and the measured matmul peak."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import jax

    devices = jax.devices()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }


def median_seconds(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> float:
    """Median wall time of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(n: int = 2048, dtype: str = "float32") -> float:
    """FLOP/s of a jitted n x n x n matmul on the default device: the MFU denominator."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    seconds = median_seconds(lambda: matmul(a, b).block_until_ready(), warmup=2, repeats=5)
    return 2 * n**3 / seconds


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's JSON line (always the last line of stdout)."""
    print(json.dumps(result, sort_keys=True))
