"""The quickstart's tiny model and synthetic parquet, written once for the trainer tests."""

import pytest
from _quickstart import asset_paths

from jaxrl.assets import prepare
from jaxrl.config import load_config
from jaxrl.sharding.processes import to_host
from jaxrl.trainer.ppo_trainer import PPOTrainer


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    prepare(load_config("configs/quickstart.yaml", asset_paths(root, root / "run")))
    return root


@pytest.fixture
def step_batches(monkeypatch):
    """Every training step's batch (host arrays) once its advantages are in, as a list that
    the test's runs fill."""
    captured = []
    advantages = PPOTrainer._advantages

    def spy(self, batch, extra):
        out = advantages(self, batch, extra)
        captured.append(to_host(out[0].present()))
        return out

    monkeypatch.setattr(PPOTrainer, "_advantages", spy)
    return captured
