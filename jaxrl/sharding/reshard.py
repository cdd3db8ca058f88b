"""verl's 3D-HybridEngine as a re-layout: moving parameters between layouts on device.

The actor trains in the train layout (ZeRO-3 over fsdp, tensor-parallel over tp) and generates
in the rollout layout (tensor-parallel only, replicated over dp, often bf16), possibly on a
mesh that factors the same devices differently, or on a disjoint set of devices. `reshard`
moves a parameter tree from its current shardings to the target ones:

- same devices: one jitted identity (with the dtype cast) per bucket, `out_shardings` = target;
  XLA lowers it to collectives, nothing goes through the host;
- disjoint devices: the cast runs on the source devices, then `jax.device_put` copies device to
  device.

A cross-mesh re-layout of one big program can materialise whole tensors as temporaries on every
device (XLA: "involuntary full rematerialization"), i.e. a full replicated copy of the model.
Resharding in buckets (default: one tensor at a time) bounds that temporary by the largest
bucket. `reshard_report` measures all of it from the compiled programs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _devices(sharding) -> frozenset:
    return frozenset(sharding.device_set)


def _buckets(sizes: Sequence[int], bucket_bytes: int | None) -> list[list[int]]:
    """Consecutive leaf indices grouped so each group stays within `bucket_bytes` (a tensor
    larger than that is a bucket of its own); None: one tensor per bucket."""
    if bucket_bytes is None:
        return [[i] for i in range(len(sizes))]
    groups: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if groups[-1] and total + size > bucket_bytes:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


@functools.lru_cache(maxsize=256)
def _relayout_fn(out_shardings: tuple, dtypes: tuple):
    def cast(*xs):
        return tuple(x if d is None else x.astype(d) for x, d in zip(xs, dtypes, strict=True))

    return jax.jit(cast, out_shardings=out_shardings)


def _target_dtype(x, dtype) -> Any:
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    return jnp.dtype(dtype)


def reshard(tree: Any, target_shardings: Any, dtype: Any = None, bucket_bytes: int | None = None):
    """A copy of `tree` laid out by `target_shardings` (and cast to `dtype` if given).

    Args:
        tree: Arrays (e.g. parameters in the train layout). Not modified or donated.
        target_shardings: A matching tree of `NamedSharding`s (e.g.
            `jaxrl.models.param_shardings(config, rollout)`).
        dtype: Floating-point leaves are cast to this dtype (the rollout dtype); None keeps.
        bucket_bytes: Re-layout this many source bytes per program; None: one tensor each.

    Returns:
        The re-laid-out tree. Free it with `free(tree)` when generation is done.
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(target_shardings)
    out: list[Any] = [None] * len(leaves)
    for group in _buckets([x.nbytes for x in leaves], bucket_bytes):
        xs = [leaves[i] for i in group]
        shardings = tuple(targets[i] for i in group)
        dtypes = tuple(_target_dtype(x, dtype) for x in xs)
        same_devices = all(
            _devices(x.sharding) == _devices(s) for x, s in zip(xs, shardings, strict=True)
        )
        if same_devices:
            results = _relayout_fn(shardings, dtypes)(*xs)
        else:  # disaggregated: cast where the data is, then copy device to device
            sources = tuple(x.sharding for x in xs)
            cast = _relayout_fn(sources, dtypes)(*xs)
            results = [_copy(c, s) for c, s in zip(cast, shardings, strict=True)]
        for i, r in zip(group, results, strict=True):
            out[i] = r
    return jax.tree.unflatten(treedef, out)


def _copy(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    """`x` copied onto other devices in `target`: `jax.device_put` within one process (it
    reshards as it copies), `moved` between processes (where it cannot)."""
    if jax.process_count() == 1:
        return jax.device_put(x, target)
    return moved(x, target)


def moved(x: jax.Array, target: jax.sharding.NamedSharding) -> jax.Array:
    """`x` in `target`, on its devices or any others, dispatched without waiting for `x`
    (`jax.device_put` between shardings that do not match shard for shard waits for its
    input, which would serialize a placed role's pass with the next):

    - same devices: a jitted identity into `target` (XLA's collectives);
    - other devices, cut alike (the same mesh shape and spec): each target device gets the
      shard of the source device at its place;
    - other devices otherwise: whole on its own devices, each target device gets a whole
      copy, then it is cut to `target` on the target's devices (a whole copy lives on each
      group until it is cut).

    The groups may span processes (every process calls it). A copy between two devices of
    one process is a local one; between processes it is JAX's cross-host transfer (over the
    socket `jaxrl.distributed` opens), which takes a single device at each end.
    """
    source = x.sharding
    if source == target:
        return x
    if _devices(source) == _devices(target):
        return _relayout_fn((target,), (None,))(x)[0]
    whole_to_whole = source.is_fully_replicated and target.is_fully_replicated
    if jax.process_count() == 1 and (_alike(source, target) or whole_to_whole):
        return jax.device_put(x, target)  # one process: a copy that does not wait
    if _alike(source, target) and not source.is_fully_replicated:
        at = list(source.mesh.devices.flat)
        return _device_copies(x, target, lambda i, device: at[i])
    whole = jax.sharding.NamedSharding(source.mesh, jax.sharding.PartitionSpec())
    x = moved(x, whole)
    copied = _device_copies(x, target.update(spec=jax.sharding.PartitionSpec()), _nearest(x))
    return moved(copied, target)


def _nearest(x: jax.Array):
    """For a whole copy: the source device for the i-th target device, one of its own
    process's where there is one (a local copy), else another process's."""
    sources = list(x.sharding.mesh.devices.flat)

    def pick(i: int, device) -> Any:
        near = [d for d in sources if d.process_index == device.process_index]
        return (near or sources)[i % len(near or sources)]

    return pick


def _device_copies(x: jax.Array, target: jax.sharding.NamedSharding, source_of) -> jax.Array:
    """`x` in `target`, each target device's shard copied from the shard `x` holds on
    `source_of(i, device)` (the same block). Every process makes the copies its devices
    take part in, and every cross-process one."""
    mine = {s.device: s.data for s in x.addressable_shards}
    shape, me = target.shard_shape(x.shape), jax.process_index()
    pieces = []
    for i, device in enumerate(target.mesh.devices.flat):
        source = source_of(i, device)
        if source.process_index == device.process_index:  # a local copy on that process
            if device.process_index == me:
                pieces.append(jax.device_put(mine[source], device))
            continue
        local = [mine[source]] if source in mine else []
        one = jax.make_array_from_single_device_arrays(
            shape, _whole_sharding([source]), local, dtype=x.dtype
        )
        copy = jax.device_put(one, _whole_sharding([device]))
        if device.process_index == me:
            pieces.append(copy.addressable_data(0))
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces, dtype=x.dtype)


def _alike(a: jax.sharding.Sharding, b: jax.sharding.Sharding) -> bool:
    """Whether `a` and `b` cut an array alike on their devices (the same mesh shape and
    spec, or both whole on every device of equally many)."""
    if a.is_fully_replicated and b.is_fully_replicated:
        return len(a.device_set) == len(b.device_set)
    named = isinstance(a, jax.sharding.NamedSharding) and isinstance(b, jax.sharding.NamedSharding)
    return (
        named
        and a.mesh.axis_names == b.mesh.axis_names
        and a.mesh.devices.shape == b.mesh.devices.shape
        and a.spec == b.spec
    )


def _whole_sharding(devices: list) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.asarray(devices), ("copy",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def spanning(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding | None:
    """For a sharding whose devices miss some processes (a role placed on some processes'
    devices only): the same cut on k copies of its mesh, a leading `copies` axis over its
    own devices (copy 0) and groups of other devices that together reach every process
    (`copy_groups`); None when its devices are on every process already. What a
    multi-process save needs (orbax refuses an array that is all one process's) at the
    least memory: copy 0 is the array itself and writes it, the others hold its shards
    while it is written."""
    mesh = sharding.mesh
    groups = copy_groups(list(mesh.devices.flat), jax.devices(), "an array's mesh")
    if not groups:
        return None
    grid = [mesh.devices] + [np.asarray(g).reshape(mesh.devices.shape) for g in groups]
    wide = jax.sharding.Mesh(np.stack(grid), ("copies", *mesh.axis_names))
    return jax.sharding.NamedSharding(wide, sharding.spec)


def copy_groups(own: Sequence[Any], everywhere: Sequence[Any], role: str) -> list[list[Any]]:
    """Groups of len(own) devices outside `own` (`role`'s devices), together holding a
    device of every process of `everywhere` that `own` misses (each such process's first
    device first, then the rest in process order), as few as can; [] when `own` is on
    every process.

    Raises:
        ValueError: when the devices outside `own` are too few, naming the role, the counts
            and the keys.
    """
    mine = {d.process_index for d in own}
    missing = sorted({d.process_index for d in everywhere} - mine)
    if not missing:
        return []
    others = sorted((d for d in everywhere if d not in own), key=lambda d: (d.process_index, d.id))
    firsts = [next(d for d in others if d.process_index == p) for p in missing]
    ordered = firsts + [d for d in others if d not in firsts]
    size = len(own)
    copies = -(-len(missing) // size)
    if copies * size > len(ordered):
        fix = ("place more devices on the other roles (mesh.placement.<role>.devices; the "
               "trainer has the rest)" if role == "train"
               else f"place fewer devices on it (mesh.placement.{role}.devices)")  # fmt: skip
        raise ValueError(
            f"{role} on {size} devices of process(es) {sorted(mine)} only is checkpointed "
            f"through a copy of its state on {copies * size} devices that reach process(es) "
            f"{missing}, and only {len(ordered)} are outside it: {fix}, or set "
            "mesh.placement.spread=true"
        )
    return [ordered[i * size : (i + 1) * size] for i in range(copies)]


def onto_copies(x: jax.Array, target: jax.sharding.NamedSharding) -> jax.Array:
    """`x` in `spanning(x.sharding)`: copy 0 its own buffers, each other copy's device gets
    the shard of the device at its place in copy 0 (device to device, every process)."""
    at = list(x.sharding.mesh.devices.flat)
    return _device_copies(x, target, lambda i, device: at[i % len(at)])


def same_buffers(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` as an array in `sharding`, over `x`'s own device buffers (no copy): `sharding`
    must put on each of its addressable devices the shard `x` has there (an equivalent
    sharding, or one over a subset of `x`'s devices holding whole copies of it)."""
    shards = {s.device: s.data for s in x.addressable_shards}
    devices = sharding.addressable_devices_indices_map(x.shape)
    mine = [shards[d] for d in devices]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, mine, dtype=x.dtype)


def free(tree: Any) -> None:
    """Release the device buffers of a tree (e.g. the rollout copy after generation)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


# ---------------------------------------------------------------------------- measurement


def _per_device_bytes(shape, dtype, sharding) -> int:
    return math.prod(sharding.shard_shape(shape)) * jnp.dtype(dtype).itemsize


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...], shape) -> int:
    n = 1
    for sa, sb, dim in zip(a, b, shape, strict=True):
        lo = max(sa.indices(dim)[0], sb.indices(dim)[0])
        hi = min(sa.indices(dim)[1], sb.indices(dim)[1])
        n *= max(hi - lo, 0)
    return n


def reshard_report(
    tree: Any, target_shardings: Any, dtype: Any = None, bucket_bytes: int | None = None
) -> dict[str, float]:
    """Memory and traffic of `reshard(tree, target_shardings, dtype, bucket_bytes)`.

    Returns per-device byte counts (the largest over devices where they differ):
    `params_before` (source shards), `params_after` (target shards), `max_bucket_temp` (the
    largest XLA temporary of one bucket program), `peak` = before + after + max_bucket_temp
    (the source stays alive: training continues after generation), and `bytes_moved` (all
    devices, received bytes) and `bytes_moved_per_device` (the largest), and
    `bytes_written_per_device`: the outputs of the compiled re-layout programs (XLA's
    analysis; the copy the rollout receives, per device). `tree` may be abstract
    (`jax.ShapeDtypeStruct`s with shardings).
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(target_shardings)
    sizes = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves]
    before = sum(_per_device_bytes(x.shape, x.dtype, x.sharding) for x in leaves)
    out_dtypes = [_target_dtype(x, dtype) or x.dtype for x in leaves]
    after = sum(
        _per_device_bytes(x.shape, d, s)
        for x, d, s in zip(leaves, out_dtypes, targets, strict=True)
    )
    moved_per_device: dict[Any, int] = {}
    moved = 0
    for x, d, s in zip(leaves, out_dtypes, targets, strict=True):
        src = x.sharding.devices_indices_map(tuple(x.shape))
        for device, index in s.devices_indices_map(tuple(x.shape)).items():
            have = _overlap(index, src[device], x.shape) if device in src else 0
            got = (_overlap(index, index, x.shape) - have) * jnp.dtype(d).itemsize
            moved_per_device[device] = moved_per_device.get(device, 0) + got
            moved += got
    temps, written = [], 0
    for group in _buckets(sizes, bucket_bytes):
        xs = [leaves[i] for i in group]
        shardings = tuple(targets[i] for i in group)
        if not all(_devices(x.sharding) == _devices(s) for x, s in zip(xs, shardings, strict=True)):
            temps.append(0)  # device_put: no XLA program, buffers copied directly
            written += sum(_per_device_bytes(x.shape, d, s) for x, d, s in zip(
                xs, [out_dtypes[i] for i in group], shardings, strict=True))  # fmt: skip
            continue
        dtypes = tuple(_target_dtype(x, dtype) for x in xs)
        compiled = _relayout_fn(shardings, dtypes).lower(*xs).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        written += compiled.memory_analysis().output_size_in_bytes
    max_temp = max(temps, default=0)
    return {
        "params_before": before,
        "params_after": after,
        "max_bucket_temp": max_temp,
        "peak": before + after + max_temp,
        "bytes_moved": moved,
        "bytes_moved_per_device": max(moved_per_device.values(), default=0),
        "bytes_written_per_device": written,
        "buckets": len(temps),
    }
