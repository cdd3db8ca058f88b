"""Host data across the processes of a multi-process run (each process drives its own devices).

    rows = gather_rows({"scores": scores_n})           # [N] per process -> [P*N] everywhere
    every = allgather_objects(extra_info)              # [obj of process 0, obj of 1, ...]
    x = global_array(batch_np, sharding)               # the same host rows on every process
    host = to_host(tree_of_global_arrays)              # numpy, whatever the sharding
    start, stop = process_rows(sharding, shape)        # rows whose data this process holds

Rows of a step are split by process: process p of P holds the contiguous slice p of the global
batch (the data iterator's order). `gather_rows` concatenates the processes' rows in process
order, so every process ends up with the global batch exactly as one process would hold it.
With one process every function is the identity (or `jax.device_get`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


def _allgather(x: np.ndarray) -> np.ndarray:
    """[P, ...]: `x` (the same shape everywhere) of every process, in process order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (any picklable value), in process order."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = _allgather(np.asarray([payload.size], np.int64))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: payload.size] = payload
    every = _allgather(padded)
    return [pickle.loads(every[i, : sizes[i]].tobytes()) for i in range(len(sizes))]


def gather_rows(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array's rows (axis 0) of all processes, concatenated in process order.

    Every process must pass the same keys, with the same trailing shapes and dtypes;
    row counts may differ.

    Raises:
        ValueError: naming the array whose trailing shape or dtype differs between processes.
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if jax.process_count() == 1:
        return arrays
    layouts = allgather_objects({k: (v.shape, v.dtype.str) for k, v in arrays.items()})
    for key in arrays:
        kinds = {(shape[1:], dtype) for shape, dtype in (layout[key] for layout in layouts)}
        if len(kinds) > 1:
            raise ValueError(
                f"gather_rows: `{key}` has different trailing shapes / dtypes on different "
                f"processes: {sorted(kinds)}"
            )
    out = {}
    for key, value in arrays.items():
        counts = [layout[key][0][0] for layout in layouts]
        padded = np.zeros((max(counts), *value.shape[1:]), value.dtype)
        padded[: len(value)] = value
        every = _allgather(padded)
        out[key] = np.concatenate([every[i, : counts[i]] for i in range(len(counts))])
    return out


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array of `host` (the same full value on every process) in `sharding`: each
    process places only the shards of its own devices."""
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree: Any) -> Any:
    """numpy values of a tree of (possibly multi-process) arrays, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def process_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[int, int]:
    """[start, stop) of the rows (axis 0) of a `shape` array in `sharding` that this process's
    devices hold (the whole range when the rows are not split)."""
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
    starts, stops = [], []
    for index in index_map.values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        starts.append(start)
        stops.append(stop)
    return min(starts), max(stops)
