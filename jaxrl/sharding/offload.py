"""Parking idle state in host memory (verl's param / optimizer offload).

The reference model between its log-prob passes, or the optimizer state during generation,
lives in the host's pinned memory and comes back to the devices when needed
(`jaxrl.trainer.cluster.Cluster.on_device`); the sharding (which device holds which shard) is
kept, only the memory kind changes. The CPU, GPU and TPU backends have pinned host memory.
"""

from __future__ import annotations

from typing import Any

import jax

HOST = "pinned_host"


def supports_host_offload(device: jax.Device | None = None) -> bool:
    """Whether the backend has pinned host memory to offload to."""
    device = device or jax.devices()[0]
    return any(m.kind == HOST for m in device.addressable_memories())


def offload(tree: Any) -> Any:
    """The tree moved to pinned host memory, each leaf keeping its sharding's device layout."""
    if not supports_host_offload():
        raise RuntimeError(f"this backend has no {HOST} memory to offload to")
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), tree)


def reload(tree: Any) -> Any:
    """The tree moved back to device memory (the inverse of `offload`)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), tree)
