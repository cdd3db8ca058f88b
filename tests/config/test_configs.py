"""Every shipped config parses and validates, on one device and on eight."""

from pathlib import Path

import pytest

from jaxrl.config import load_config, save_config
from jaxrl.config.load import PPO
from jaxrl.config.offline import DPO, SFT

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
# The offline trainers' configs are named by their command (python -m jaxrl.sft / .dpo).
OFFLINE = {"sft_": SFT, "dpo_": DPO, "kto_": DPO}


def schema(path: Path):
    return next((s for prefix, s in OFFLINE.items() if path.name.startswith(prefix)), PPO)


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "ppo_gsm8k_qwen2.5_0.5b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("num_devices", [1, 8])
def test_config_validates(path, num_devices):
    load_config(path, num_devices=num_devices, schema=schema(path))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_resolved_config_reloads_identically(path, tmp_path):
    cfg = load_config(path, schema=schema(path))
    assert load_config(save_config(cfg, tmp_path), schema=schema(path)) == cfg


def test_gsm8k_ppo_mirrors_verl_quickstart():
    cfg = load_config(CONFIGS[[p.name for p in CONFIGS].index("ppo_gsm8k_qwen2.5_0.5b.yaml")])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.data.train_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.critic.model.path.endswith("Qwen2.5-0.5B-Instruct")
