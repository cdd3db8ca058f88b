"""`python -m jaxrl.sft --config configs/NAME.yaml [dotted.key=value ...]`: supervised
fine-tuning with verl's SFT trainer's keys (`jaxrl.config.offline.SFTConfig`), on the cluster
and loop the RL trainer uses (`jaxrl.trainer.offline.SFTTrainer`)."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import sys
from collections.abc import Sequence

from jaxrl.config.offline import SFT
from jaxrl.offline_cli import Command, sft_summary
from jaxrl.offline_cli import main as _main


def _build(cfg):
    from jaxrl.trainer.offline import build_sft_run

    return build_sft_run(cfg)


COMMAND = Command(
    "python -m jaxrl.sft",
    "Supervised fine-tuning (verl's SFT trainer) of a HuggingFace causal LM with JAX.",
    SFT,
    "sft",
    _build,
    sft_summary,
)


def main(argv: Sequence[str] | None = None) -> int:
    return _main(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
