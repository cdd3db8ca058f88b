"""`RolloutWeights`: the rollout's copy of the policy's weights, in its layout and dtype.

    weights = RolloutWeights(config, shardings, per_layer=True)
    weights.load(actor_params, version=3)     # jitted reshard into the rollout layout
    weights.get()                             # the copy (an error before the first load)
    weights.release()                         # free it (a LoRA base is kept)
    weights.copy_of(actor_params)             # what `load` makes, abstract
    local.borrow(view, version=3)             # hold another copy's arrays (not freed here)

`load` is the jitted re-layout of `jaxrl.sharding.reshard`: the source may live on the same
devices (colocated) or on others (the rollout on its own device group); either way one
program moves and casts every leaf, no host copy. `version` is the policy's (the trainer's
`Learner.version`); the trainer publishes each version once (`Cluster.sync_weights`).

Per layer (`per_layer`: the `xla` decode step) the copy is held as one tree per layer
(`models.cached.unstack_layers`), so the decode step reads each weight where it is instead of
slicing it from its stack; not for a LoRA copy, whose base stays stacked so that it can be
the actor's own arrays. With LoRA (`frozen_base=True`) everything but the adapters is the same
at every load: the first copies it (a leaf already in the rollout's sharding and dtype is
used as it is, not copied), later loads move only the adapters.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models import lora
from jaxrl.models.config import DecoderConfig
from jaxrl.sharding.layouts import placed_abstract
from jaxrl.sharding.reshard import free, reshard, same_buffers


class RolloutWeights:
    """The rollout's weights (module doc).

    Args:
        config: The rollout model (its `param_dtype` is the copy's dtype).
        shardings: The rollout layout's parameter shardings.
        per_layer: Hold the copy per layer (the `xla` decode step).
    """

    def __init__(self, config: DecoderConfig, shardings: Any, *, per_layer: bool):
        self.config, self.shardings, self.per_layer = config, shardings, per_layer
        self.params: Any = None
        self.version: int | None = None  # of the loaded weights
        # LoRA: the base's rollout copy, kept across loads and releases, and which of its
        # leaves are the source's own arrays (not freed)
        self.base: Any = None
        self._aliased: set[int] = set()
        self._borrowed = False  # `params` are another copy's (`borrow`)

    def load(self, params: Any, *, frozen_base: bool = False, version: int | None = None):
        """Copy `params` (any layout, any devices) into the rollout layout (cast to
        `param_dtype`), replacing (and freeing) the previous copy (module doc)."""
        self.release()
        self.version = version
        if not frozen_base:
            self._drop_base()
            copy = reshard(params, self.shardings, dtype=self.config.param_dtype)
            self.params = _split_layers(copy) if self._held_per_layer(params) else copy
            return
        base, adapters = lora.split(params)
        base_shardings, adapter_shardings = lora.split(self.shardings)
        if self.base is None:
            self.base = self._copy_base(base, base_shardings)
        adapters = reshard(adapters, adapter_shardings, dtype=self.config.param_dtype)
        self.params = lora.merge(self.base, adapters)

    def borrow(self, params: Any, *, version: int | None) -> None:
        """Hold `params`, another copy's arrays (a process-local view of them:
        `RolloutEngine.local`), without owning them: `release` forgets them, their owner
        frees them."""
        self.release()
        self._drop_base()
        self.params, self.version, self._borrowed = params, version, True

    def get(self) -> Any:
        """The loaded copy."""
        if self.params is None:
            raise RuntimeError("the rollout has no weights: call load_weights (sync_weights) first")
        return self.params

    def release(self) -> None:
        """Free the copy, except a LoRA base (kept for the next load)."""
        if self.params is not None and not self._borrowed:
            free(self.params if self.base is None else lora.split(self.params)[1])
        self.params, self._borrowed = None, False

    def copy_of(self, like: Any) -> Any:
        """What `load(like)` makes, as `jax.ShapeDtypeStruct`s in the rollout's shardings
        (nothing allocated)."""
        copy = placed_abstract(like, self.shardings, self.config.param_dtype)
        if not self._held_per_layer(like):
            return copy
        n, stacked = self.config.num_layers, copy["layers"]
        layer = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=_layer(a.sharding)),
            stacked,
        )
        return {**copy, "layers": (layer,) * n}

    def _held_per_layer(self, params: Any) -> bool:
        return self.per_layer and not lora.has_adapters(params)

    def _copy_base(self, base: Any, shardings: Any) -> Any:
        leaves, treedef = jax.tree.flatten(base)
        targets = treedef.flatten_up_to(shardings)
        dtype = np.dtype(self.config.param_dtype)
        kept = [
            x.dtype == dtype and x.sharding.is_equivalent_to(s, x.ndim)
            for x, s in zip(leaves, targets, strict=True)
        ]
        moved = reshard(
            [x for x, k in zip(leaves, kept, strict=True) if not k],
            [s for s, k in zip(targets, kept, strict=True) if not k],
            dtype=dtype,
        )
        moved_iter = iter(moved)
        out = [
            same_buffers(x, s) if k else next(moved_iter)  # on the rollout mesh itself
            for x, s, k in zip(leaves, targets, kept, strict=True)
        ]
        self._aliased = {id(x) for x, k in zip(out, kept, strict=True) if k}
        return jax.tree.unflatten(treedef, out)

    def _drop_base(self) -> None:
        """Forget the kept LoRA base (freeing what was copied, not the source's arrays)."""
        if self.base is not None:
            free([x for x in jax.tree.leaves(self.base) if id(x) not in self._aliased])
            self.base, self._aliased = None, set()


def _split_layers(params: dict[str, Any]) -> dict[str, Any]:
    """`models.cached.unstack_layers` of the rollout's own copy, on its devices, one stacked
    leaf at a time, each stack freed once split (`params` is consumed): the load's peak is
    one leaf above the stacked copy's."""
    leaves, treedef = jax.tree.flatten(params.pop("layers"))
    n, parts = leaves[0].shape[0], []
    for k in range(len(leaves)):
        stack, leaves[k] = leaves[k], None
        parts.append(_split_program(n, stack.sharding)(stack))
        del stack  # the last reference: its buffer goes now
    layers = tuple(jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(n))
    return {**params, "layers": layers}


def _layer(sharding: NamedSharding) -> NamedSharding:
    """A stacked leaf's sharding without its leading (layer) axis."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


@functools.lru_cache(maxsize=64)
def _split_program(n: int, sharding: NamedSharding):
    return jax.jit(
        lambda stack: tuple(stack[i] for i in range(n)), out_shardings=(_layer(sharding),) * n
    )
