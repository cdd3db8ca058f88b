"""`python -m jaxrl.train`: the command a user runs (in a subprocess, as a user would)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]


def run(*args: str, devices: int = 8) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-m", "jaxrl.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.entry
def test_quickstart_validates_and_writes_resolved_config(tmp_path):
    out = run("--config", "configs/quickstart.yaml", f"trainer.default_local_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "train mesh:   {'dp': 1, 'fsdp': 8, 'tp': 1, 'sp': 1}" in out.stdout
    assert "rollout mesh: {'dp': 8, 'tp': 1}" in out.stdout
    assert "8 x cpu" in out.stdout
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["algorithm"]["adv_estimator"] == "grpo"
    assert written["trainer"]["default_local_dir"] == str(tmp_path)


@pytest.mark.entry
def test_misspelt_key_names_the_right_one(tmp_path):
    out = run(
        "--config",
        "configs/quickstart.yaml",
        "actor_rollout_ref.actor.ppo_mini_bach_size=4",
        f"trainer.default_local_dir={tmp_path}",
    )
    assert out.returncode == 2
    assert "ppo_mini_bach_size" in out.stderr
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in out.stderr
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.entry
def test_mesh_that_does_not_fit_the_devices(tmp_path):
    out = run(
        "--config",
        "configs/quickstart.yaml",
        "mesh.fsdp=4",
        f"trainer.default_local_dir={tmp_path}",
        devices=8,
    )
    assert out.returncode == 2
    assert "mesh: mesh dp=1 x fsdp=4 x tp=1 x sp=1 spans 4 devices but 8" in out.stderr


@pytest.mark.entry
def test_context_length_checked_against_the_checkpoint(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 40}')
    out = run(
        "--config",
        "configs/quickstart.yaml",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path}",
    )
    assert out.returncode == 2
    assert "48 tokens exceeds the context" in out.stderr
    assert "max_position_embeddings = 40" in out.stderr


def test_help_lists_groups_and_reference():
    out = run("--help")
    assert out.returncode == 0
    for group in ("data", "actor_rollout_ref", "critic", "algorithm", "trainer", "mesh"):
        assert f"  {group} " in out.stdout
    assert "docs/config.md" in out.stdout
