"""`python -m jaxrl.dpo --config configs/NAME.yaml [dotted.key=value ...]`: preference
optimisation, DPO and its variants or KTO (`dpo.loss_type`), with TRL's `DPOConfig` /
`KTOConfig` keys under `dpo.*` (`jaxrl.config.offline.DPOConfig`), on the cluster and loop the
RL trainer uses (`jaxrl.trainer.offline.PreferenceTrainer`)."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import sys
from collections.abc import Sequence

from jaxrl.config.offline import DPO
from jaxrl.offline_cli import Command, dpo_summary
from jaxrl.offline_cli import main as _main


def _build(cfg):
    from jaxrl.trainer.offline import build_preference_run

    return build_preference_run(cfg)


COMMAND = Command(
    "python -m jaxrl.dpo",
    "Preference optimisation (DPO variants, KTO; TRL's trainers) of a HuggingFace causal LM "
    "with JAX.",
    DPO,
    "dpo",
    _build,
    dpo_summary,
)


def main(argv: Sequence[str] | None = None) -> int:
    return _main(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
