"""Checkpoints of a run with orbax: saved asynchronously, written atomically, restored straight
into the target shardings.

    ckpt = Checkpoints(run_dir / "checkpoints", max_to_keep=2)
    ckpt.save(step, {"actor": actor_state, "critic": critic_state}, meta)   # returns at once
    state, meta = ckpt.restore(step, {"actor": abstract_actor, ...})         # ShapeDtypeStructs
                                                                            # with shardings
`meta` is JSON: the global step, the data iterator's state, the KL controller's coefficient,
and what `jaxrl.export` needs (the actor's HF config). Orbax writes each step into a temporary
folder and renames it when complete, so a process killed during a save leaves the previous
checkpoint as the latest restorable one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with the current shardings) of a tree of arrays: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpoints:
    """A folder of step checkpoints (`<dir>/<step>/{state items, meta}`)."""

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = None):
        self.directory = Path(directory).expanduser().absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start saving `state` (pytrees of arrays) and `meta` (JSON) as `step`; returns
        before the write completes (`wait` blocks until it has)."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in state.items()}
        self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))

    def restore(self, step: int, targets: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """(state, meta) of `step`, each tree laid out like its target (see `abstract`)."""
        items = {name: ocp.args.StandardRestore(t) for name, t in targets.items()}
        out = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **items)
        )
        return {name: out[name] for name in targets}, dict(out["meta"])

    def read_meta(self, step: int) -> dict[str, Any]:
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
