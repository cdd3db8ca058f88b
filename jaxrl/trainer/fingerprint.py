"""Determinism fingerprints: short hashes of a step's inputs and of the parameters it produced,
written with every step's metrics (`fingerprint/*` in `metrics.jsonl`), so that two runs or a
resumed run compare step by step (`python -m jaxrl.compare`). A run on N processes against one
on one process agrees on `fingerprint/inputs` (the same rollouts and scores) while its
parameters may differ in the last bits: the collectives reduce in another order.

The parameter hash is a jitted reduction on the devices, never a host copy. Each element's bits
b (as uint32) at flat position i of leaf l are mixed and summed modulo 2^32:

    h_l = sum_i mix(b_i + K1 * i),   H = sum_l mix(h_l + K2 * l),   mix(x) = (x ^ (x >> 16)) * K3

Integer addition modulo 2^32 is associative and commutative, so the sum is bit-identical however
the arrays are sharded or reduced (any mesh, any process count), while a change of any bit, or
of an element's position, changes it (with probability ~1 - 2^-32). The inputs hash is the same
reduction over the step's prompt and response tokens, masks and scores on the devices (their
rows split over the data axes; no process reads them for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.sharding.processes import to_host

K1, K2, K3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D  # odd 32-bit constants (golden ratio, murmur3)
INPUT_KEYS = ("prompts", "prompt_mask", "responses", "response_mask", "token_level_scores")


def _bits(x: jax.Array) -> jax.Array:
    """The elements' bit patterns as uint32 (wider types folded, narrower zero-extended)."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 8:
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [n, 2]
        return halves[:, 0] ^ (halves[:, 1] * jnp.uint32(K3))
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _mix(x: jax.Array) -> jax.Array:
    return (x ^ (x >> 16)) * jnp.uint32(K3)


@jax.jit
def tree_hash(tree: Any) -> jax.Array:
    """A uint32 hash of every bit of a pytree of arrays, independent of their sharding."""
    total = jnp.uint32(0)
    for index, leaf in enumerate(jax.tree.leaves(tree)):
        bits = _bits(jnp.asarray(leaf))
        positions = jnp.arange(bits.shape[0], dtype=jnp.uint32)
        leaf_hash = jnp.sum(_mix(bits + positions * jnp.uint32(K1)), dtype=jnp.uint32)
        total = total + _mix(leaf_hash + jnp.uint32((K2 * index) & 0xFFFFFFFF))
    return total


def step_fingerprints(
    inputs: Mapping[str, jax.Array], param_hashes: Mapping[str, jax.Array]
) -> dict[str, str]:
    """`fingerprint/inputs` of the step's batch (`tree_hash` of its `INPUT_KEYS` fields, on
    the devices where they are) and `fingerprint/<role>` of each role's parameters after the
    step (`tree_hash`es), as 8 hex digits; one read of 4 bytes each."""
    hashes = {"inputs": tree_hash({k: inputs[k] for k in INPUT_KEYS if k in inputs})}
    hashes = to_host({**hashes, **param_hashes})
    return {f"fingerprint/{name}": f"{int(value):08x}" for name, value in hashes.items()}
