"""`python -m jaxrl.export --checkpoint DIR --out HF_DIR`: a checkpoint's actor as an HF folder
(verl's model merger).

DIR is a step folder of a run's checkpoints (`.../checkpoints/40`), a run's `checkpoints`
folder, or a run directory (both: the newest step). The folder written has the original
checkpoint's `config.json` entries, the trained weights (safetensors) and the tokenizer, and
loads with `transformers.AutoModelForCausalLM.from_pretrained`.

A LoRA run's checkpoint is written as a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`, loaded onto the base by `peft.PeftModel.from_pretrained`), or with
`--merge` as a whole HF checkpoint with the adapters merged into the weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxrl.export")


def resolve_step(path: Path) -> tuple[Path, int]:
    """(checkpoints folder, step) for a step folder, a checkpoints folder or a run directory."""
    path = path.expanduser().absolute()
    if path.name.isdigit() and path.is_dir():
        return path.parent, int(path.name)
    for folder in (path, path / "checkpoints"):
        steps = [int(p.name) for p in folder.glob("*") if p.name.isdigit() and p.is_dir()]
        if steps:
            return folder, max(steps)
    raise FileNotFoundError(
        f"{path}: no checkpoint found; pass a run directory, its checkpoints folder, or a step "
        "folder such as RUN/checkpoints/40"
    )


def read_actor(checkpoint: str | Path, merge: bool = True) -> tuple[Any, Any, Path, dict]:
    """(config, params, the model folder it was trained from, the checkpoint's meta) of the
    actor of `checkpoint` (a step folder, a checkpoints folder or a run directory), on the
    first device. A LoRA run's params are its adapters, or with `merge` the base as it was
    loaded with the adapters beside its weights (the config's LoRA spec applies them)."""
    import jax

    from jaxrl.checkpoint import Checkpoints
    from jaxrl.models import abstract_params, from_pretrained, load_config
    from jaxrl.models.config import LoraSpec
    from jaxrl.models.lora import merge as merge_trees
    from jaxrl.models.lora import split

    folder, step = resolve_step(Path(checkpoint))
    ckpts = Checkpoints(folder)
    meta = ckpts.read_meta(step)
    source = Path(meta["model_path"])
    options = dict(override_config=meta.get("override_config") or None)
    config = load_config(source, param_dtype=meta["param_dtype"], **options)
    adapter = meta.get("actor_lora")
    if adapter is not None:
        spec = LoraSpec(adapter["rank"], adapter["alpha"], tuple(adapter["targets"]))
        config = config.replace(lora=spec)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract_params(config)
    )
    if adapter is not None:
        target = split(target)[1]
    params = ckpts.restore_item(step, "actor_params", target)
    ckpts.close()
    if adapter is not None and merge:  # the base as it was loaded, the adapters merged into it
        _, base = from_pretrained(source, dtype=meta["param_dtype"], **options)
        params = merge_trees(base, params)
    return config, params, source, meta


def export(
    checkpoint: str | Path, out: str | Path, dtype: str | None = None, merge: bool = False
) -> Path:
    """Write the actor of `checkpoint` to `out`: an HF folder, or for a LoRA run a PEFT adapter
    folder (`merge`: the HF folder of the base with the adapters merged in); returns `out`."""
    from jaxrl.models import save_pretrained
    from jaxrl.models.peft_io import save_adapter

    config, params, source, meta = read_actor(checkpoint, merge=merge)
    if meta.get("actor_lora") is not None and not merge:
        out = save_adapter(config, params, out, base_model=str(source), dtype=dtype)
        _save_tokenizer(source, out)
        return out
    tokenizer = None
    try:
        from jaxrl.data import load_tokenizer

        tokenizer = load_tokenizer(str(source))
    except (OSError, ValueError):
        pass  # a checkpoint without a tokenizer: weights and config only
    base = json.loads((source / "config.json").read_text())
    out = save_pretrained(config, params, out, tokenizer, dtype=dtype, base_config=base)
    if tokenizer is not None:
        check_auto_tokenizer(out, tokenizer)
    return out


def _save_tokenizer(source: Path, out: Path) -> None:
    """The base's tokenizer beside an adapter (as PEFT users save it), when it has one."""
    try:
        from jaxrl.data import load_tokenizer

        load_tokenizer(str(source)).save_pretrained(str(out))
    except (OSError, ValueError):
        pass


def check_auto_tokenizer(folder: Path, tokenizer) -> bool:
    """Whether transformers' `AutoTokenizer` loads the exported tokenizer so that it encodes
    like the one training used (probed on a sample of its vocabulary and on plain text); a
    difference is logged as a warning naming both classes."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # the export is written: report, do not fail it
        log.warning("%s: transformers' AutoTokenizer cannot load the tokenizer: %r", folder, e)
        return False
    words = [w for w in list(tokenizer.get_vocab())[:200] if w.isprintable() and " " not in w]
    probes = [" ".join(words), "Hello, world! 12 + 30 = 42", "repeat: 7"]
    for text in probes:
        if loaded.encode(text) != tokenizer.encode(text):
            log.warning(
                "%s: transformers' AutoTokenizer loads the tokenizer as %s, which encodes %r "
                "differently from the %s used in training; load it with "
                "jaxrl.data.load_tokenizer (or PreTrainedTokenizerFast.from_pretrained), or "
                "export a model family whose tokenizer class transformers trusts (llama)",
                folder, type(loaded).__name__, text[:40], type(tokenizer).__name__,
            )  # fmt: skip
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl.export", description=__doc__)
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="step, checkpoints or run dir"
    )
    parser.add_argument("--out", type=Path, required=True, help="HF folder to write")
    parser.add_argument("--dtype", default=None, help="storage dtype (default: the parameters')")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA run: write the base with the adapters merged (default: a PEFT adapter folder)",
    )
    args = parser.parse_args(argv)
    from jaxrl.checkpoint import CheckpointError  # jax and orbax: after --help

    try:
        path = export(args.checkpoint, args.out, args.dtype, merge=args.merge)
    except (FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
