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
            results = [jax.device_put(c, s) for c, s in zip(cast, shardings, strict=True)]
        for i, r in zip(group, results, strict=True):
            out[i] = r
    return jax.tree.unflatten(treedef, out)


def moved(x: jax.Array, target: jax.sharding.NamedSharding) -> jax.Array:
    """`x` in `target`, on its devices or any others, dispatched without waiting for `x`
    (`jax.device_put` between shardings that do not match shard for shard waits for its
    input, which would serialize a placed role's pass with the next):

    - same devices: a jitted identity into `target` (XLA's collectives);
    - other devices, laid out alike (the same mesh shape and spec, or both whole on every
      device): a device-to-device copy, shard for shard;
    - other devices otherwise: whole on its own devices, copied whole (`_copy_whole`), then
      cut to `target` on the target's (a whole copy lives on each group until it is cut).

    The groups may belong to other processes (every process calls it; with
    `jaxrl.distributed`'s cross-host transfers, the copies go device to device between them).
    """
    source = x.sharding
    if source == target:
        return x
    if _devices(source) == _devices(target):
        return _relayout_fn((target,), (None,))(x)[0]
    if _alike(source, target):
        return jax.device_put(x, target)
    whole = jax.sharding.NamedSharding(source.mesh, jax.sharding.PartitionSpec())
    copied = _copy_whole(moved(x, whole), target.update(spec=jax.sharding.PartitionSpec()))
    return moved(copied, target)


def _copy_whole(x: jax.Array, target: jax.sharding.NamedSharding) -> jax.Array:
    """`x`, whole on each of its devices, whole on each of `target`'s (other devices; a copy
    goes between device lists of one size): the target's devices in turns of at most as
    many as `x` has, each turn a copy from as many of `x`'s devices."""
    mine = {s.device: s.data for s in x.addressable_shards}
    sources = list(x.sharding.mesh.devices.flat)
    targets = list(target.mesh.devices.flat)
    pieces = []
    for start in range(0, len(targets), len(sources)):
        turn = targets[start : start + len(sources)]
        buffers = [mine.get(d) for d in sources[: len(turn)]]
        here = _whole_on(x.shape, x.dtype, sources[: len(turn)], buffers)
        copy = jax.device_put(here, _whole_sharding(turn))
        pieces += [s.data for s in copy.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces, dtype=x.dtype)


def _whole_sharding(devices: list) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.asarray(devices), ("copy",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _whole_on(shape: tuple[int, ...], dtype, devices: list, buffers: list) -> jax.Array:
    """An array whole on `devices`, over their `buffers` (None on other processes' devices)."""
    local = [b for b in buffers if b is not None]
    sharding = _whole_sharding(devices)
    return jax.make_array_from_single_device_arrays(shape, sharding, local, dtype=dtype)


def _alike(a: jax.sharding.Sharding, b: jax.sharding.Sharding) -> bool:
    """Whether a copy from `a` to `b` goes shard for shard (other devices, the same cut)."""
    if a.is_fully_replicated and b.is_fully_replicated:
        return True
    named = isinstance(a, jax.sharding.NamedSharding) and isinstance(b, jax.sharding.NamedSharding)
    return (
        named
        and a.mesh.axis_names == b.mesh.axis_names
        and a.mesh.devices.shape == b.mesh.devices.shape
        and a.spec == b.spec
    )


def same_buffers(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` as an array in `sharding`, over `x`'s own device buffers (no copy): `sharding`
    must put on each of its addressable devices the shard `x` has there (an equivalent
    sharding, or one over a subset of `x`'s devices holding whole copies of it)."""
    shards = {s.device: s.data for s in x.addressable_shards}
    devices = sharding.addressable_devices_indices_map(x.shape)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [shards[d] for d in devices])


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
