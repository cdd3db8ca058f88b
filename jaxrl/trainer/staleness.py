"""The staleness rules of `async_training.mode=fully_async`, apart from threads and devices
(the rollouter and the trainer ask it; a property test drives it in a simulation).

    gate = StalenessGate(per_step=R, trigger=T, threshold=θ)
    gate.may_start()        # the rollouter may start another group now
    gate.start()            # ... and did; it carries the current push index
    gate.push(carried)      # the trainer published new weights; `carried` groups in flight
    gate.release()          # a group was dropped or aborted before it was trained
    gate.too_stale(first)   # a group whose first token came from push `first`: not trained

verl's `fully_async_policy` counts, per weights version, the groups the rollouter has started
(those still in flight or queued at the push count again) and pauses generation once they
reach `max_required_samples` = R x T x (1 + θ): R groups per step (`require_batches` x
`ppo_mini_batch_size`), a push every T steps (`trigger_parameter_sync_step`), θ the
`staleness_threshold`. Stale groups are thus mostly never produced. The trainer takes R groups
a step, R x T between two pushes, so with groups taken in the order they finish, every group
is trained at most ceil(1 + θ) pushes after the one its first token was sampled with. A long
group (the tail of the lengths) can finish later than that; the gate's `bound` makes the rule
hard: a group older than `bound` pushes is dropped (in flight: aborted at the push) and its
prompt generated again, never trained. The trainer never waits on a gate that cannot open: a
dropped group gives its start back (`release`).
"""

from __future__ import annotations

import math


def groups_cap(per_step: int, trigger: int, threshold: float) -> int:
    """Groups that may start per weights version, those carried over included:
    R x T x (1 + θ), at least R. The groups running at once never exceed it."""
    return max(int(per_step * trigger * (1 + threshold)), per_step)


class StalenessGate:
    """How many groups the rollouter may start, and which the trainer may use (module doc).

    Args:
        per_step: R, groups a training step takes.
        trigger: T, steps between two weight pushes.
        threshold: θ >= 0, the share of extra groups started per version.

    Attributes:
        cap: Groups that may be started per version, those carried over included.
        bound: The most pushes a trained group's first token may be behind the trainer.
        started: Groups started since the last push, with those it carried.
        pushes: Pushes so far (the current weights' index).
    """

    def __init__(self, per_step: int, trigger: int, threshold: float):
        if per_step < 1 or trigger < 1 or threshold < 0:
            raise ValueError(
                f"StalenessGate(per_step={per_step}, trigger={trigger}, threshold={threshold}): "
                "per_step and trigger must be >= 1, threshold >= 0"
            )
        self.cap = groups_cap(per_step, trigger, threshold)
        self.bound = math.ceil(1 + threshold)
        self.started = 0
        self.pushes = 0

    def may_start(self) -> bool:
        """Whether another group may start under the current weights."""
        return self.started < self.cap

    def start(self) -> int:
        """Count a started group; returns the push index its first token samples with."""
        self.started += 1
        return self.pushes

    def release(self) -> None:
        """A started group will not be trained (dropped or aborted): its start is free."""
        self.started = max(self.started - 1, 0)

    def push(self, carried: int) -> None:
        """New weights; `carried` groups started before are still in flight or queued."""
        self.pushes += 1
        self.started = carried

    def lag(self, first: int) -> int:
        """Pushes between a group's first token (`first`) and the current weights."""
        return self.pushes - first

    def too_stale(self, first: int) -> bool:
        """Whether a group whose first token came from push `first` is past the bound."""
        return self.lag(first) > self.bound
