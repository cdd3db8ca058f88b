"""The quickstart's tiny model and synthetic parquet, written once for the trainer tests."""

import pytest
from _quickstart import asset_paths

from jaxrl.assets import prepare
from jaxrl.config import load_config


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    prepare(load_config("configs/quickstart.yaml", asset_paths(root, root / "run")))
    return root
