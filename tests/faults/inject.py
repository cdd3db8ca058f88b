"""Run `python -m jaxrl.train` with a fault injected from inside (test harness, not shipped).

    python tests/faults/inject.py nan-grads STEPS -- TRAIN_ARGS...

`nan-grads 3,4`: in training steps 3 and 4, the gradient accumulated over the actor's first
micro-batch is replaced by NaN (one micro-batch's loss or gradient going non-finite), so those
optimizer steps see a non-finite gradient norm.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxrl import train
from jaxrl.trainer import learner, ppo_trainer

current_step = [0]


def nan_grads(steps: set[int]) -> None:
    step_fn = ppo_trainer.PPOTrainer.step
    init = learner.Learner.__init__

    def step(self, batch, step_number):
        current_step[0] = step_number
        return step_fn(self, batch, step_number)

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        accumulate = self._accumulate

        def poisoned(params, acc, mb, info, frozen):
            acc, metrics = accumulate(params, acc, mb, info, frozen)
            step_number = current_step[0]
            if step_number in steps and getattr(self, "_poisoned_step", 0) != step_number:
                self._poisoned_step = step_number  # the step's first micro-batch only
                acc = jax.tree.map(lambda g: g * jnp.nan, acc)
            return acc, metrics

        self._accumulate = poisoned

    ppo_trainer.PPOTrainer.step = step
    learner.Learner.__init__ = patched_init


if __name__ == "__main__":
    kind, steps, sep, *train_args = sys.argv[1:]
    assert kind == "nan-grads" and sep == "--", sys.argv
    nan_grads({int(s) for s in steps.split(",")})
    sys.exit(train.main(train_args))
