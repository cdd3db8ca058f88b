"""`python -m jaxrl.train`: the command a user runs (in a subprocess, as a user would)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _env import subprocess_env

ROOT = Path(__file__).parents[1]


def run(*args: str, devices: int = 8) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxrl.train", *args],
        cwd=ROOT,
        env=subprocess_env(devices),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.entry
def test_quickstart_makes_its_assets_and_trains(tmp_path):
    """The README's main job, shortened to two steps, with its assets in a fresh folder."""
    run_dir = tmp_path / "run"
    out = run(
        "--config",
        "configs/quickstart.yaml",
        f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.model.path={tmp_path}/model",
        f"assets.dir={tmp_path}",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/test.parquet",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
    )
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path}/model" in out.stdout
    assert "train mesh:   {'dp': 1, 'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1}" in out.stdout
    assert "rollout mesh: {'dp': 8, 'tp': 1}" in out.stdout
    assert "8 x cpu" in out.stdout
    assert "done:" in out.stdout
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["algorithm"]["adv_estimator"] == "grpo"
    assert written["trainer"]["default_local_dir"] == str(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    assert "val-core/jaxrl/synthetic_repeat/acc/mean@1" in rows[-1]
    assert (run_dir / "curves.png").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]


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
    want = (
        "mesh.ep, mesh.tp, mesh.sp: mesh dp=1 x fsdp=4 x ep=1 x tp=1 x sp=1 spans 4 devices but 8"
    )
    assert want in out.stderr


@pytest.mark.entry
def test_context_length_checked_against_the_checkpoint(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 20}')
    out = run(
        "--config",
        "configs/quickstart.yaml",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path}",
    )
    assert out.returncode == 2
    assert "24 tokens exceeds the context" in out.stderr
    assert "max_position_embeddings = 20" in out.stderr


def test_help_lists_groups_and_reference():
    out = run("--help")
    assert out.returncode == 0
    for group in ("data", "actor_rollout_ref", "critic", "algorithm", "trainer", "mesh"):
        assert f"  {group} " in out.stdout
    assert "docs/config.md" in out.stdout
