"""Logical axis names -> `NamedSharding`s on a mesh, by a rule table (a layout).

A layout maps each logical name (`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`layers`, `labels`, `batch`, `seq`) to a mesh axis, a tuple of mesh axes, or None (replicated).
Names a layout does not mention are replicated. A dimension whose size does not divide by its
mesh axes is replicated too, rather than failing at placement; for a parameter
(`tree_shardings`) that is logged once as a warning naming it (it costs memory on every
device of those axes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None]

log = logging.getLogger("jaxrl.sharding")
_warned: set[tuple[str, int, tuple[str, ...]]] = set()


def _axes(rule: str | Sequence[str] | None) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def partition_spec(
    shape: Sequence[int],
    logical: Sequence[str | None],
    mesh: Mesh,
    rules: Rules,
    where: str | None = None,
) -> PartitionSpec:
    """The `PartitionSpec` for one array; indivisible or repeated mesh axes are replicated
    (an indivisible dimension of the array named `where` is logged once)."""
    used: set[str] = set()
    spec: list[Any] = []
    for dim, (size, name) in enumerate(zip(shape, logical, strict=True)):
        axes = tuple(a for a in _axes(rules.get(name)) if a in mesh.shape and a not in used)
        parts = math.prod(mesh.shape[a] for a in axes)
        if axes and size % parts == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
            continue
        spec.append(None)
        if axes and parts > 1 and where is not None and (where, dim, axes) not in _warned:
            _warned.add((where, dim, axes))
            log.warning(
                "%s: dimension %d (%s, size %d) does not divide over mesh axes %s (%d "
                "shards): replicated on them",
                where, dim, name, size, "x".join(axes), parts,
            )  # fmt: skip
    return PartitionSpec(*spec)


def sharding_for(
    shape: Sequence[int],
    logical: Sequence[str | None],
    mesh: Mesh,
    rules: Rules,
    where: str | None = None,
) -> NamedSharding:
    """A `NamedSharding` for one array with the given logical axis names."""
    return NamedSharding(mesh, partition_spec(shape, logical, mesh, rules, where))


def tree_shardings(abstract: Any, logical: Any, mesh: Mesh, rules: Rules) -> Any:
    """`NamedSharding`s for a tree of arrays (or ShapeDtypeStructs) and its logical-name tree;
    a dimension that stays replicated for want of divisibility is logged with its key path."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, names: sharding_for(
            x.shape, names, mesh, rules, jax.tree_util.keystr(path)
        ),
        abstract,
        logical,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, str | None) for n in x),
    )
