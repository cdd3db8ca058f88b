"""A layout is a mesh plus logical-axis rules; it names the sharding of every array jaxrl makes.

    train, rollout = layouts_from_config(cfg)
    param_shardings = jaxrl.models.param_shardings(model_config, train)   # NamedSharding tree
    with use_layout(train):
        loss = jax.jit(loss_fn, in_shardings=...)(params, batch)   # shard() constraints apply

`shard(x, ("batch", "seq", None))` constrains an activation to the active layout; without an
active layout it returns `x` unchanged, so the models run as they are on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config.checks import role_devices
from jaxrl.config.mesh import AXES, ROLLOUT_RULES, TRAIN_RULES, resolve_axis_sizes
from jaxrl.sharding.logical import partition_spec, tree_shardings
from jaxrl.sharding.mesh import make_mesh
from jaxrl.sharding.reshard import copy_groups

# The KV cache [L, B, S, K, H] and the token batch [B, T].
TOKEN_AXES = ("batch", "seq")


def _freeze_rules(rules: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    def freeze(v):
        return tuple(v) if isinstance(v, list | tuple) else v

    return tuple(sorted((k, freeze(v)) for k, v in rules.items()))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules mapping logical axis names onto its axes (hashable).

    Attributes:
        mesh: The device mesh.
        rules: (logical name, mesh axis / tuple of axes / None) pairs.
    """

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, Any]) -> Layout:
        return cls(mesh, _freeze_rules(rules))

    @property
    def rule_map(self) -> dict[str, Any]:
        return dict(self.rules)

    def spec(self, shape: Sequence[int], logical: Sequence[str | None]) -> PartitionSpec:
        return partition_spec(shape, logical, self.mesh, self.rule_map)

    def sharding(self, shape: Sequence[int], logical: Sequence[str | None]) -> NamedSharding:
        """The sharding of one array of this shape and logical axes."""
        return NamedSharding(self.mesh, self.spec(shape, logical))

    def tree(self, abstract: Any, logical: Any) -> Any:
        """Shardings for a tree of arrays / ShapeDtypeStructs and its logical-name tree."""
        return tree_shardings(abstract, logical, self.mesh, self.rule_map)

    def tokens(self, shape: Sequence[int]) -> NamedSharding:
        """Sharding of a [B, T] token / mask batch (batch and sequence axes)."""
        return self.sharding(shape, TOKEN_AXES[: len(shape)])

    def batch_shards(self) -> int:
        """Devices the `batch` axis is split over (the product of its rule's mesh axes)."""
        rule = self.rule_map.get("batch")
        axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        return math.prod(self.mesh.shape[a] for a in axes if a in self.mesh.shape)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def optimizer_state(self, optimizer: Any, opt_state_abstract: Any, param_shardings: Any):
        """Shardings of an optax state: parameter-shaped leaves (moments) like the parameters,
        everything else (step counts) replicated."""
        import optax

        replicated = self.replicated()
        return optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, sharding: sharding,
            opt_state_abstract,
            param_shardings,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
        )


def train_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The training mesh (dp, fsdp, tp, sp) over `devices` (default: all)."""
    return make_mesh({a: sizes.get(a, 1) for a in AXES}, devices)


def rollout_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The generation mesh (dp = rest, tp) over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(resolve_axis_sizes({"dp": -1, "tp": tp}, len(devices)), devices)


def role_layouts(cfg, devices: Sequence[jax.Device] | None = None) -> dict[str, Layout]:
    """The layouts of a `jaxrl.config.Config`'s device groups (`mesh.placement`): `train`
    (mesh `mesh.dp/fsdp/tp/sp` over the trainer's devices), `rollout` (dp = the rest x
    `rollout.tensor_model_parallel_size`, over its own group when placed, else the trainer's
    devices), and each other placed role (`ref`, `critic`, `reward`, `teacher`: a mesh of its
    `mesh.placement.<role>` sizes with the train rules)."""
    devices = list(jax.devices() if devices is None else devices)
    on = _group_devices(role_devices(cfg, len(devices)), devices, cfg.mesh.placement.spread)
    _check_owners(cfg, on)
    train_rules = cfg.mesh.train_rules or TRAIN_RULES
    sizes = {a: getattr(cfg.mesh, a) for a in AXES}
    layouts = {"train": Layout.create(make_mesh(sizes, on["train"]), train_rules)}
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    rollout_devices = on.get("rollout", on["train"])
    rollout_rules = cfg.mesh.rollout_rules or ROLLOUT_RULES
    layouts["rollout"] = Layout.create(rollout_mesh(tp, rollout_devices), rollout_rules)
    for role in ("ref", "critic", "reward", "teacher"):
        if role in on:
            group = getattr(cfg.mesh.placement, role)
            sizes = {a: getattr(group, a) for a in AXES}
            layouts[role] = Layout.create(make_mesh(sizes, on[role]), train_rules)
    return layouts


def _group_devices(
    groups: Mapping[str, range], devices: list, spread: bool = True
) -> dict[str, list]:
    """Each group's devices. One process, or `spread` false: the ranges of `devices` in
    process order, as they are. Several and `spread`: each group takes the same share of
    every process's devices (the trainer the first of each process's, then each placed role
    its slice), so every process holds part of every role, as one process would hold all of
    them.

    Raises:
        ValueError: spread, for a group whose device count does not divide by the processes.
    """
    owners = sorted({d.process_index for d in devices})
    if len(owners) == 1 or not spread:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return {role: [ordered[i] for i in group] for role, group in groups.items()}
    local = {p: [d for d in devices if d.process_index == p] for p in owners}
    out = {}
    for role, group in sorted(groups.items(), key=lambda kv: kv[0] == "train"):  # train last
        if len(group) % len(owners) or group.start % len(owners):
            raise ValueError(
                f"with {len(owners)} processes every placed role takes the same number of each "
                f"process's devices: make mesh.placement.{role}.devices ({len(group)}) a "
                f"multiple of {len(owners)}, or set mesh.placement.spread=false (each role a "
                "range of the devices in process order)"
            )
        first, share = group.start // len(owners), len(group) // len(owners)
        out[role] = [d for p in owners for d in local[p][first : first + share]]
    return out


def _check_owners(cfg, on: Mapping[str, list]) -> None:
    """`mesh.placement.spread=false` with several processes: the trainer and a placed
    critic on some processes only have devices outside them for their checkpoint's copies
    (`reshard.copy_groups`), and a placed rollout holds devices on every process for
    streamed dynamic sampling (each process streams its groups on its own rollout devices;
    the agent loop routes the conversations of a process without any to one with some).

    Raises:
        ValueError: naming the role or feature, the processes it misses and the keys.
    """
    every_device = [d for group in on.values() for d in group]
    for role in ("train", "critic"):
        if role in on:
            copy_groups(on[role], every_device, role)
    every = {d.process_index for d in every_device}
    rollout = on.get("rollout", on["train"])  # unplaced: the trainer's devices
    missing = sorted(every - {d.process_index for d in rollout})
    if cfg.algorithm.filter_groups.streaming and missing:
        raise ValueError(
            f"the rollout has no device on process(es) {missing} with mesh.placement.spread="
            "false: algorithm.filter_groups.streaming runs each process's groups on its own "
            "rollout devices; place fewer devices elsewhere, or set "
            "mesh.placement.spread=true"
        )


def layouts_from_config(cfg, devices: Sequence[jax.Device] | None = None) -> tuple[Layout, Layout]:
    """The (train, rollout) layouts of a `jaxrl.config.Config` (see `role_layouts`)."""
    layouts = role_layouts(cfg, devices)
    return layouts["train"], layouts["rollout"]


# ------------------------------------------------------------------ activation constraints

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[Layout | None]:
    """Make `layout` the one `shard()` constrains to while tracing inside this block."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    return _ACTIVE.get()


def shard(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names; a no-op without an active layout."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(x.shape, logical))


def placed_abstract(tree: Any, shardings: Any, dtype: Any = None) -> Any:
    """`tree` (arrays or `jax.ShapeDtypeStruct`s) as `ShapeDtypeStruct`s placed by the matching
    tree `shardings`, in `dtype` when given: what `jit(...).lower` takes to compile for arrays
    that are not allocated."""
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(
            x.shape, x.dtype if dtype is None else dtype, sharding=sharding
        ),
        tree,
        shardings,
    )
