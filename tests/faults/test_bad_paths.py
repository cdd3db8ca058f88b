"""Paths as a new user gets them wrong: a typo in a path copied from the quickstart config, a
model folder that does not exist, is empty, or lacks weights or a tokenizer. Each is refused
before anything loads, with the key, the path and what is missing, and nothing is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _env import subprocess_env

pytestmark = pytest.mark.faults

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "quickstart.yaml")
QWEN2 = json.dumps({"model_type": "qwen2"})


def train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--config", CONFIG, *overrides],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def train_model(
    tmp_path: Path, model: Path, files: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Train on the model folder `model` (without the quickstart's assets), after writing
    `files` (name -> text) into it; None: the folder is not made."""
    if files is not None:
        model.mkdir()
    for name, text in (files or {}).items():
        (model / name).write_text(text)
    return train(
        tmp_path,
        "assets.quickstart=false",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path}/run",
    )


def assert_refused(out: subprocess.CompletedProcess, *expected: str) -> None:
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for text in expected:
        assert text in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "key, value",
    [("data.train_files", "data/typo.parquet"), ("actor_rollout_ref.model.path", "models/typo")],
)
@pytest.mark.fault(
    fault="A typo in a data or model path with `assets.quickstart` on",
    outcome=(
        "Refused: the key, the path, and that the quickstart writes only inside `assets.dir`; "
        "nothing is written"
    ),
    lost="Nothing",
)
def test_typo_in_a_quickstart_path_is_not_filled_with_made_up_data(tmp_path, key, value):
    out = train(tmp_path, f"{key}={value}", f"trainer.default_local_dir={tmp_path}/run")
    assert_refused(
        out,
        f"{key}={value}: no such",
        "assets.quickstart writes missing files only inside assets.dir=~/.cache/jaxrl/quickstart",
    )
    assert not (tmp_path / value).exists()


@pytest.mark.fault(
    fault="A model path that does not exist",
    outcome="Refused before anything loads, naming the key and the path",
    lost="Nothing",
)
def test_missing_model_folder_names_the_key(tmp_path):
    out = train_model(tmp_path, tmp_path / "nowhere")
    assert_refused(out, f"actor_rollout_ref.model.path={tmp_path}/nowhere: no such folder")


@pytest.mark.fault(
    fault="An empty model folder",
    outcome="Refused, listing the missing `config.json` and weights",
    lost="Nothing",
)
def test_empty_model_folder_says_what_is_missing(tmp_path):
    empty = tmp_path / "empty"
    out = train_model(tmp_path, empty, files={})
    assert_refused(
        out,
        f"actor_rollout_ref.model.path={empty}: no config.json",
        f"actor_rollout_ref.model.path={empty}: no model.safetensors",
    )


@pytest.mark.fault(
    fault="A model folder without tokenizer files",
    outcome="Refused, naming the tokenizer files looked for",
    lost="Nothing",
)
def test_model_without_a_tokenizer(tmp_path):
    model = tmp_path / "model"
    out = train_model(tmp_path, model, {"config.json": QWEN2, "model.safetensors": ""})
    assert_refused(out, f"actor_rollout_ref.model.path={model}: no tokenizer files")


@pytest.mark.fault(
    fault="A model folder with only `.bin` weights",
    outcome="Refused, with the conversion to safetensors as the fix",
    lost="Nothing",
)
def test_torch_weights_only_get_the_conversion_hint(tmp_path):
    files = {"config.json": QWEN2, "pytorch_model.bin": "", "tokenizer.json": "{}"}
    out = train_model(tmp_path, tmp_path / "model", files)
    assert_refused(
        out, "(found ['pytorch_model.bin']: convert them with transformers' save_pretrained)"
    )
