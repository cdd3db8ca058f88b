"""Overrides that point the quickstart config at the `assets` fixture's files."""

import jax

from jaxrl.compare import VOLATILE
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


def assert_same_metrics(a: list[dict], b: list[dict], steps: list[int]) -> None:
    """Run b logged `steps`, and every metric of every step equals run a's (timings aside)."""
    assert [r["training/global_step"] for r in b] == steps
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if not key.startswith(VOLATILE):
                assert rb[key] == value, (ra["training/global_step"], key, value, rb[key])
