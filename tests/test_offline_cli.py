"""`python -m jaxrl.sft` and `python -m jaxrl.dpo`: the README's offline demos, shortened, in a
subprocess on 8 CPU devices, as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _env import subprocess_env

ROOT = Path(__file__).parents[1]


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=subprocess_env(8),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.entry
@pytest.mark.parametrize(
    ("module", "config", "prefix", "metric"),
    [("jaxrl.sft", "configs/sft_quickstart.yaml", "sft", "val/exact_match"),
     ("jaxrl.dpo", "configs/dpo_quickstart.yaml", "dpo", "eval_rewards/accuracies")],
)  # fmt: skip
def test_demo_makes_its_assets_and_trains(tmp_path, module, config, prefix, metric):
    run_dir = tmp_path / "run"
    out = run(
        module, "--config", config,
        f"trainer.default_local_dir={run_dir}", f"model.path={tmp_path}/model",
        f"assets.dir={tmp_path}", f"data.train_files={tmp_path}/{prefix}_train.parquet",
        f"data.val_files={tmp_path}/{prefix}_test.parquet", "assets.train_size=128",
        "assets.val_size=16", "trainer.total_training_steps=3", "trainer.test_freq=3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path}/model" in out.stdout and "done:" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in rows] == [0, 1, 2, 3]
    assert metric in rows[0] and metric in rows[-1]
    assert (run_dir / "curves.png").is_file()
    assert (run_dir / "checkpoints").is_dir()


@pytest.mark.entry
def test_misspelt_key_names_the_right_one():
    out = run("jaxrl.dpo", "--config", "configs/dpo_quickstart.yaml", "dpo.bta=0.2")
    assert out.returncode == 2
    assert "did you mean 'dpo.beta'" in out.stderr
