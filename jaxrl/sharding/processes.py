"""Host data across the processes of a multi-process run (each process drives its own devices).

    rows = gather_rows({"scores": scores_n})           # [N] per process -> [P*N] everywhere
    received_bytes()                                   # what has crossed to this host so far
    every = allgather_objects(extra_info)              # [obj of process 0, obj of 1, ...]
    first, total = row_span(len(rows))                 # where this process's rows start
    x = global_array(batch_np, sharding)               # the same host rows on every process
    host = to_host(tree_of_global_arrays)              # numpy, whatever the sharding
    start, stop = process_rows(sharding, shape)        # rows whose data this process holds
    if holds_rows(sharding, shape, first, first + n):  # each process's own rows on its devices
        own = read_rows(tree_of_global_arrays, first, first + n)  # from its shards alone
    mesh = local_mesh(rollout_mesh)                    # this process's rows of a (dp, ...) mesh
    whole = one_device_each()                          # one device of each process
    local = local_view(params, mesh)                   # its shards of them, no copy

Rows of a step are split by process: process p of P holds the contiguous slice p of the global
batch (the data iterator's order). `gather_rows` concatenates the processes' rows in process
order, so every process ends up with the global batch exactly as one process would hold it.
With one process every function is the identity (or `jax.device_get`).

`local_mesh` and `local_view` give a process its own share of a mesh whose first axis (`dp`)
is split over the processes and whose other axes (`tp`) are not: a mesh of the same axes over
its devices only, and arrays replicated along the first axis viewed on it (the same device
buffers, no transfer). Programs on them run on this process alone: what each process's
conversations (the agent loop, streamed groups) need, since their requests arrive and end at
each process's own pace.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.sharding.reshard import moved, same_buffers

_RECEIVED = [0]  # bytes of the other processes' host data received (`received_bytes`)


def received_bytes() -> int:
    """Bytes of the other processes' data this process has received through the hosts so
    far: the all-gathers of this module (`gather_rows`, `allgather_objects`, `row_span`, and
    `to_host` of split arrays), (P - 1) / P of each gathered buffer, and the buffers
    `to_host` copies device to device from the processes that hold an array it holds none
    of; 0 with one process."""
    return _RECEIVED[0]


def _count_received(gathered: Any) -> None:
    p = jax.process_count()
    _RECEIVED[0] += sum(np.asarray(x).nbytes for x in jax.tree.leaves(gathered)) * (p - 1) // p


def _allgather(x: np.ndarray) -> np.ndarray:
    """[P, ...]: `x` (the same shape everywhere, at most 32-bit) of every process, in process
    order."""
    from jax.experimental import multihost_utils

    out = np.asarray(multihost_utils.process_allgather(x, tiled=False))
    _count_received(out)
    return out


def _allgather_bytes(rows: np.ndarray) -> list[np.ndarray]:
    """Every process's uint8 [n_p, w] (the same w everywhere; any n_p), in process order. The
    gathered buffer is padded to a power of two rows, so payloads of varying size reuse a
    handful of compiled all-gathers."""
    counts = _allgather(np.asarray([len(rows)], np.int32))[:, 0]
    size = 1 << max(int(counts.max()) - 1, 0).bit_length()
    padded = np.zeros((size, rows.shape[1]), np.uint8)
    padded[: len(rows)] = rows
    every = _allgather(padded)
    return [every[i, : counts[i]] for i in range(len(counts))]


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (any picklable value), in process order."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    return [pickle.loads(b.tobytes()) for b in _allgather_bytes(payload[:, None])]


def gather_rows(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array's rows (axis 0) of all processes, concatenated in process order.

    Every process must pass the same keys, each with the same trailing shape and dtype
    (numeric or bool, any width: rows travel as raw bytes); row counts may differ.

    Raises:
        ValueError: on every process, naming the keys or the array whose trailing shape or
            dtype differs between processes.
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if jax.process_count() == 1:
        return arrays
    for key, value in arrays.items():
        if value.dtype.hasobject or value.ndim == 0:
            raise ValueError(f"gather_rows: `{key}` must be a numeric array with rows")
    layouts = allgather_objects({k: (v.shape, v.dtype.str) for k, v in arrays.items()})
    keys = [sorted(layout) for layout in layouts]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"gather_rows: the processes pass different arrays: {keys}")
    for key in keys[0]:
        kinds = {(shape[1:], dtype) for shape, dtype in (layout[key] for layout in layouts)}
        if len(kinds) > 1:
            raise ValueError(
                f"gather_rows: `{key}` has different trailing shapes / dtypes on different "
                f"processes: {sorted(kinds)}"
            )
    # One payload per process: every array's bytes, key after key; one all-gather in all.
    payload = np.concatenate([np.frombuffer(arrays[k].tobytes(), np.uint8) for k in keys[0]])
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys[0]}
    for layout, data in zip(layouts, _allgather_bytes(payload[:, None]), strict=True):
        data, start = data[:, 0], 0
        for key in keys[0]:
            shape, dtype = layout[key]
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            parts[key].append(data[start : start + size].view(dtype).reshape(shape))
            start += size
    return {k: np.concatenate(parts[k]) for k in keys[0]}


def row_span(count: int) -> tuple[int, int]:
    """(first, total): where this process's `count` rows start in the global batch (the
    rows of the processes before it), and the global batch's rows (every process's)."""
    if jax.process_count() == 1:
        return 0, count
    counts = _allgather(np.asarray([count], np.int32))[:, 0]
    return int(counts[: jax.process_index()].sum()), int(counts.sum())


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array of `host` (the same full value on every process) in `sharding`: each
    process places only the shards of its own devices."""
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


def to_host(tree: Any) -> Any:
    """numpy values of a tree of arrays (host, single-process or multi-process, sharded or
    replicated) on every process: what `jax.device_get` gives with one process.

    With several processes every process passes the same arrays (global ones: each the
    output of one program on every process; a process-local array is read with
    `np.asarray`). An array split over every process is all-gathered through the hosts; one
    on some processes' devices only (a role placed with `mesh.placement.spread=false`)
    reaches the others device to device (`_from_some_processes`).
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    out, split, some = [], [], []
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and len(owners(x.sharding.device_set)) < jax.process_count():
            some.append(i)
            x = None
        elif isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                split.append(i)
            x = x.addressable_data(0) if x.is_fully_replicated else None
        out.append(x)
    out = jax.device_get(out)
    if split:  # one collective for all of them
        gathered = multihost_utils.process_allgather([leaves[i] for i in split], tiled=True)
        _count_received(gathered)
        for i, x in zip(split, gathered, strict=True):
            out[i] = np.asarray(x)
    if some:  # every process has the same (global arrays)
        for i, x in zip(some, _from_some_processes([leaves[i] for i in some]), strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def owners(devices: Iterable[jax.Device]) -> set[int]:
    """The processes of `devices` (an array's `sharding.device_set`, a mesh's
    `devices.flat`)."""
    return {d.process_index for d in devices}


def _from_some_processes(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    """numpy values of arrays on some processes' devices only, on every process. The arrays
    of each device group are packed into one byte buffer on their devices (one program),
    copied whole onto one device of each process (`reshard.moved`), and cut apart on the
    host: one transfer per group, whatever the number of arrays.

    Raises:
        ValueError: on every process, when the processes pass different arrays (a
            process-local one: each process's own devices), naming them.
    """
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        mesh = getattr(x.sharding, "mesh", None)  # its order: one program's devices
        by_id = sorted(x.sharding.device_set, key=lambda d: d.id)
        order = mesh.devices.flat if mesh is not None else by_id
        groups.setdefault(tuple(order), []).append(i)
    passed = [([d.id for d in g], [xs[i].shape for i in groups[g]]) for g in groups]
    every = allgather_objects(passed)  # a small collective: a mismatch would hang the copies
    if any(p != every[0] for p in every):
        raise ValueError(
            "to_host: the processes pass different arrays (device ids and shapes per "
            f"process: {every}); a process-local array is read with np.asarray"
        )
    out: list[Any] = [np.empty(x.shape, x.dtype) for x in xs]  # empty ones stay so
    copies = {}
    for devices, members in groups.items():  # every group dispatched, then read
        parts = [xs[i] for i in members if xs[i].size]
        if parts:
            whole = NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("all",)), PartitionSpec())
            copies[devices] = moved(_pack(whole)(*parts), one_device_each())
    for devices, packed in copies.items():
        data = np.asarray(packed.addressable_data(0))
        members = [i for i in groups[devices] if xs[i].size]
        if jax.process_index() not in owners(xs[members[0]].sharding.device_set):
            _RECEIVED[0] += data.nbytes
        start = 0
        for i in members:
            size = xs[i].size * np.dtype(xs[i].dtype).itemsize
            out[i] = data[start : start + size].view(xs[i].dtype).reshape(xs[i].shape)
            start += size
    return out


@functools.lru_cache(maxsize=64)
def _pack(whole: NamedSharding):
    """A program: its arrays' bytes, one after the other, as one uint8 vector whole on each
    of `whole`'s devices."""

    def pack(*xs: jax.Array) -> jax.Array:
        return jnp.concatenate([_bytes(x) for x in xs])

    return jax.jit(pack, out_shardings=whole)


def _bytes(x: jax.Array) -> jax.Array:
    """uint8 [x.nbytes]: `x`'s bytes in C order (a bool is one byte, as in numpy)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def one_device_each(split: bool = False) -> NamedSharding:
    """A sharding over the first device of every process, in process order: whole on each,
    or with `split` its rows (axis 0) split, process p's block on process p's device."""
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
              for p in range(jax.process_count())]  # fmt: skip
    mesh = jax.sharding.Mesh(np.asarray(firsts), ("process",))
    return NamedSharding(mesh, PartitionSpec("process") if split else PartitionSpec())


def spans_processes(mesh: jax.sharding.Mesh) -> bool:
    """Whether `mesh` has devices of other processes than this one."""
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def local_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The rows of `mesh` (along its first axis) whose devices are this process's: a mesh of
    the same axes, its first axis this process's share (`mesh` itself in one process).

    Raises:
        ValueError: when a row mixes this process's devices with another's (a `tp` group
            spanning processes), naming the row.
    """
    if not spans_processes(mesh):
        return mesh
    me = jax.process_index()
    rows = mesh.devices.reshape(mesh.devices.shape[0], -1)
    mine = []
    for i, row in enumerate(rows):
        owners = sorted({d.process_index for d in row})
        if me in owners and len(owners) > 1:
            raise ValueError(
                f"mesh row {i} along `{mesh.axis_names[0]}` has devices of processes {owners}: "
                f"each of its {mesh.axis_names[1:]} groups must sit on one process (make "
                "actor_rollout_ref.rollout.tensor_model_parallel_size divide the devices per "
                "process)"
            )
        if owners == [me]:
            mine.append(i)
    if not mine:
        raise ValueError(f"mesh {dict(mesh.shape)} has no device of process {me}")
    return jax.sharding.Mesh(mesh.devices[np.asarray(mine)], mesh.axis_names,
                             axis_types=mesh.axis_types)  # fmt: skip


def local_view(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Each leaf of `tree` (arrays in `NamedSharding`s over a mesh of which `mesh` is this
    process's `local_mesh`) as an array over `mesh`, made of the leaf's own shards on those
    devices (no copy; they stay valid while the leaf's buffers are).

    Raises:
        ValueError: for a leaf split along the first mesh axis (each process holds only part
            of it), naming its spec.
    """
    first = mesh.axis_names[0]

    def view(x: jax.Array) -> jax.Array:
        spec = x.sharding.spec
        if any(first in ((a,) if isinstance(a, str) else tuple(a or ())) for a in spec):
            raise ValueError(
                f"local_view: an array in {spec} is split along `{first}`; only arrays "
                f"replicated along it have a whole copy on each process"
            )
        return same_buffers(x, NamedSharding(mesh, spec))

    if not any(spans_processes(x.sharding.mesh) for x in jax.tree.leaves(tree)):
        return tree
    return jax.tree.map(view, tree)


def process_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[int, int]:
    """[start, stop) of the rows (axis 0) of a `shape` array in `sharding` that this process's
    devices hold (the whole range when the rows are not split; (0, 0) when it holds none)."""
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
    starts, stops = [], []
    for index in index_map.values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        starts.append(start)
        stops.append(stop)
    return (min(starts), max(stops)) if starts else (0, 0)


def holds_rows(
    sharding: jax.sharding.Sharding, shape: Sequence[int], start: int, stop: int
) -> bool:
    """Whether, on every process, the devices of `sharding` hold exactly that process's rows
    [start, stop) of a `shape` array (each passes its own): then each process can place and
    read its rows alone. A collective (one small all-gather) when there are several."""
    mine = process_rows(sharding, shape) == (start, stop)
    return all(allgather_objects(mine))


def read_rows(tree: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of each array of `tree` as numpy, read from this process's own
    shards (no collective; one device read per shard).

    Raises:
        ValueError: when this process's shards of an array do not cover those rows.
    """

    def read(x: jax.Array) -> np.ndarray:
        out = np.zeros((stop - start, *x.shape[1:]), x.dtype)
        covered = np.zeros(stop - start, bool)
        distinct = {}  # one of the copies of each block (replicas over the other axes)
        for shard in x.addressable_shards:
            lo, hi, _ = shard.index[0].indices(x.shape[0])
            if max(lo, start) < min(hi, stop):
                distinct.setdefault(tuple((i.start, i.stop) for i in shard.index), shard)
        shards = list(distinct.values())
        for shard, data in zip(shards, jax.device_get([s.data for s in shards]), strict=True):
            lo, hi, _ = shard.index[0].indices(x.shape[0])
            a, b = max(lo, start), min(hi, stop)
            out[(slice(a - start, b - start), *shard.index[1:])] = data[a - lo : b - lo]
            covered[a - start : b - start] = True
        if not covered.all():
            raise ValueError(
                f"read_rows: this process's shards of a {x.shape} array do not hold rows "
                f"[{start}, {stop}) (it holds {process_rows(x.sharding, x.shape)})"
            )
        return out

    return jax.tree.map(read, tree)
