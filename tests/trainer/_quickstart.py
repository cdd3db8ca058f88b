"""Overrides that point the quickstart config at the `assets` fixture's files."""

import jax

from jaxrl.config import load_config


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
