"""Every shipped config parses and validates, on one device and on eight."""

from pathlib import Path

import pytest

from jaxrl.config import load_config, save_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "ppo_gsm8k_qwen2.5_0.5b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("num_devices", [1, 8])
def test_config_validates(path, num_devices):
    load_config(path, num_devices=num_devices)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_resolved_config_reloads_identically(path, tmp_path):
    cfg = load_config(path)
    assert load_config(save_config(cfg, tmp_path)) == cfg


def test_gsm8k_ppo_mirrors_verl_quickstart():
    cfg = load_config(CONFIGS[[p.name for p in CONFIGS].index("ppo_gsm8k_qwen2.5_0.5b.yaml")])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.data.train_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.critic.model.path.endswith("Qwen2.5-0.5B-Instruct")
