"""Run `python -m jaxrl.train` with a fault injected from inside (test harness, not shipped).

    python tests/faults/inject.py nan-grads STEPS -- TRAIN_ARGS...

`nan-grads 3,4`: in training steps 3 and 4, the gradient accumulated over the actor's first
micro-batch is replaced by NaN (one micro-batch's loss or gradient going non-finite), so those
optimizer steps see a non-finite gradient norm.

`kill-in-commit 1`: the process SIGKILLs itself when the save of step 1 is about to be
committed (orbax has renamed the step folder, jaxrl has not written its manifest).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxrl import checkpoint, train
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


def kill_in_commit(steps: set[int]) -> None:
    write_manifest = checkpoint.write_manifest

    def killed(step_dir: Path) -> None:
        if int(step_dir.name) in steps:
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(step_dir)

    checkpoint.write_manifest = killed


FAULTS = {"nan-grads": nan_grads, "kill-in-commit": kill_in_commit}

if __name__ == "__main__":
    kind, steps, sep, *train_args = sys.argv[1:]
    assert kind in FAULTS and sep == "--", sys.argv
    FAULTS[kind]({int(s) for s in steps.split(",")})
    sys.exit(train.main(train_args))
