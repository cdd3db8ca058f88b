"""What `fit` needs of a trainer: the `Trainer` protocol.

`fit` owns the loop, validation cadence, checkpoints, logs and resume; a trainer owns its
algorithm. PPO/GRPO (`PPOTrainer`) is one; a DPO or SFT trainer over the same `Cluster` is
another, and `fit` drives any of them through these four methods only:

    metrics = trainer.step(batch, global_step)      # one step; metrics (and fingerprints)
    metrics = trainer.validate(loader, global_step) # one validation pass
    items, meta = trainer.state_items()             # arrays (restored in their shardings)
    trainer.restore(items, meta)                    #   and JSON of a checkpoint

`fit` adds `global_step` and the data iterator's state to `meta`; a resumed run restores the
trainer's state, then the iterator, then continues at the next step.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxrl.data.iterator import PromptIterator


@runtime_checkable
class Trainer(Protocol):
    def step(self, batch: Any, global_step: int) -> dict[str, float]:
        """Train on `batch` (the loader's next item) as step `global_step` (from 1)."""
        ...

    def validate(self, loader: PromptIterator, global_step: int) -> dict[str, float]:
        """One pass over the validation loader; its metrics."""
        ...

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(arrays, JSON-able meta) a checkpoint holds. `fit` adds the loader's state as
        meta's `data` unless the trainer gives it (one that draws from the loader itself)."""
        ...

    def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
        """Put back a checkpoint's state (`items` already in this trainer's shardings)."""
        ...
