"""Overrides that point the quickstart config at the `assets` fixture's files, and the
helpers that compare runs."""

import math

import jax
import jax.numpy as jnp

from jaxrl.compare import VOLATILE
from jaxrl.config import load_config
from jaxrl.trainer.ppo_trainer import PPOTrainer


def asset_paths(root, run_dir) -> list[str]:
    """The model, the data (8 validation rows) and the run folder `run_dir`."""
    return [
        f"actor_rollout_ref.model.path={root}/model",
        f"assets.dir={root}",
        f"data.train_files={root}/train.parquet",
        f"data.val_files={root}/test.parquet",
        f"trainer.default_local_dir={run_dir}",
        "assets.val_size=8",
    ]


def quickstart_config(root, run_dir, *overrides):
    """The quickstart config on the fixture's files, with `overrides`, checked against the
    devices JAX sees."""
    overrides = [*asset_paths(root, run_dir), *overrides]
    return load_config("configs/quickstart.yaml", overrides, num_devices=jax.device_count())


def assert_same_metrics(a: list[dict], b: list[dict], steps: list[int]) -> None:
    """Run b logged `steps`, and every metric of every step equals run a's (timings aside)."""
    assert [r["training/global_step"] for r in b] == steps
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if not key.startswith(VOLATILE):
                assert rb[key] == value, (ra["training/global_step"], key, value, rb[key])


def assert_close_metrics(
    a: list[dict], b: list[dict], steps: list[int], *, rtol: float, atol: float
) -> None:
    """As `assert_same_metrics`, numbers within `rtol`/`atol`, and of the fingerprints only
    the inputs' (the token ids: exact; the others hash floats)."""
    assert [r["training/global_step"] for r in b] == steps
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if key.startswith(VOLATILE) or (
                key.startswith("fingerprint/") and key != "fingerprint/inputs"
            ):
                continue
            close = rb[key] == value or (
                isinstance(value, float) and math.isclose(rb[key], value, rel_tol=rtol,
                                                          abs_tol=atol)
            )  # fmt: skip
            assert close, (ra["training/global_step"], key, value, rb[key])


def lagged_weights(monkeypatch, save_freq: int) -> None:
    """Make synchronous PPO steps generate with `async_training.mode=one_step_off`'s weights:
    step k with the weights from before update k-1, or, after a step that saved (every
    `save_freq`: it looked no batch ahead), with the current ones; step 1 with the initial
    ones."""
    snapshots = []  # the actor's weights at the start of step k: snapshots[k - 1]
    step = PPOTrainer.step

    def lagged(self, prompts, global_step):
        actor = self.cluster.actor
        snapshots.append(jax.tree.map(jnp.copy, actor.params))
        drained = global_step == 1 or (save_freq > 0 and (global_step - 1) % save_freq == 0)
        weights = snapshots[global_step - 1 if drained else global_step - 2]
        # published under the current version: the step's own publication is then a no-op
        self.cluster.rollout.load_weights(weights, version=actor.version)
        return step(self, prompts, global_step)

    monkeypatch.setattr(PPOTrainer, "step", lagged)
