"""Files a run makes for itself, offline (`assets.*`): the quickstart's tiny policy and task.

    written = jaxrl.assets.prepare(cfg)   # paths created; [] when everything exists

With `assets.quickstart`, a missing `actor_rollout_ref.model.path` becomes a tiny random Llama
policy (2 layers, hidden 64, tied embeddings; initialised by jaxrl, no torch needed) with the
synthetic task's word-level tokenizer (a llama `config.json` lets transformers' `AutoTokenizer`
load that tokenizer as it is; for qwen2 it substitutes a byte-level BPE `Qwen2Tokenizer`), and
missing `data.train_files` / `data.val_files` become verl-format parquet of
`jaxrl.data.synthetic`'s task. Nothing that exists is overwritten, and
nothing is written outside `assets.dir`: a missing path elsewhere (a typo in an override) is a
`ConfigError` naming its key, never a silent run on made-up data.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from jaxrl.config import ConfigError

QUICKSTART_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.absolute())


def _refuse_outside(cfg, paths: dict[str, Path]) -> None:
    """Missing paths outside `assets.dir` are typos, not files to make."""
    folder = Path(cfg.assets.dir).expanduser()
    problems = [
        f"{key}={path}: no such {'model folder' if key.endswith('model.path') else 'file'}; "
        f"assets.quickstart writes missing files only inside assets.dir={cfg.assets.dir} "
        "(fix the path, or set assets.dir to the folder the quickstart should fill)"
        for key, path in paths.items()
        if not _inside(path, folder)
    ]
    if problems:
        raise ConfigError(problems)


def _single(files, key: str) -> Path:
    if files is None:
        raise ConfigError([f"assets.quickstart writes a parquet file to {key}: set it to a path"])
    files = [files] if isinstance(files, str) else list(files)
    if len(files) != 1:
        raise ConfigError(
            [f"assets.quickstart writes one parquet file; {key} lists {len(files)} files"]
        )
    return Path(files[0]).expanduser()


def write_quickstart_model(
    folder: Path, seed: int = 0, tools: bool = False, prior_steps: int = 600
) -> None:
    """A tiny random Llama causal LM and its tokenizer, as an HF checkpoint folder. With
    `tools`, the tool task's tokenizer (`synthetic.write_tokenizer(tools=True)`) and weights
    fitted to the call format by `prior_steps` steps (`jaxrl.assets_tools`)."""
    import jax
    from transformers import LlamaConfig

    from jaxrl import assets_tools
    from jaxrl.data import load_tokenizer, synthetic
    from jaxrl.models import from_hf_config, init_params, save_pretrained

    with tempfile.TemporaryDirectory() as tmp:  # write whole, then copy in
        staging = Path(tmp) / "model"
        synthetic.write_tokenizer(staging, tools=tools)
        tokenizer = load_tokenizer(str(staging))
        vocab = -(-len(tokenizer) // 8) * 8
        hf = LlamaConfig(
            vocab_size=vocab,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            **QUICKSTART_MODEL,
        )
        config = from_hf_config(hf)
        params = init_params(config, jax.random.key(seed))
        if tools:  # the tool demo starts from a policy that knows the call format
            data = assets_tools.demonstrations(tokenizer, 2048, seed=seed)
            params = assets_tools.imitate(config, params, data, steps=prior_steps, seed=seed)
        save_pretrained(config, params, staging, tokenizer, base_config=hf.to_dict())
        folder.mkdir(parents=True, exist_ok=True)  # may exist (without a config.json)
        shutil.copytree(  # config.json last: its presence means the folder is complete
            staging, folder, dirs_exist_ok=True, ignore=lambda d, names: ["config.json"]
        )
        shutil.copy2(staging / "config.json", folder / "config.json")


def prepare(cfg, kind: str = "rl") -> list[str]:
    """Create the missing files `cfg.assets` asks for; returns what was written. `kind`:
    `rl` (`Config`: the policy and verl-format prompts), `sft` or `dpo` (the offline
    configs: the same policy at `model.path`, and SFT or TRL preference rows of the task)."""
    if not cfg.assets.quickstart:
        return []
    from jaxrl.data import synthetic

    makers = {
        "rl": synthetic.make_records,
        "sft": synthetic.sft_records,
        "dpo": synthetic.preference_records,
    }
    if kind == "rl":
        model_key, model_path = "actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path
    else:
        model_key, model_path = "model.path", cfg.model.path
    return _prepare(cfg, model_key, Path(model_path).expanduser(), makers[kind])


def _refresh_template(model: Path) -> list[str]:
    """The tool model's chat template as `synthetic` writes it now, over an older cache's
    (one written before the template rendered an assistant's `tool_calls`, which an external
    agent's calls need to chain: `jaxrl.serve.external`); the weights are kept."""
    from jaxrl.data import synthetic

    file = model / "chat_template.jinja"
    if not file.is_file() or file.read_text() == synthetic.HERMES_CHATML_TEMPLATE:
        return []
    file.write_text(synthetic.HERMES_CHATML_TEMPLATE)
    return [str(file)]


def _prepare(cfg, model_key: str, model: Path, make_records) -> list[str]:
    from jaxrl.data.rows import write_parquet

    written = []
    train = _single(cfg.data.train_files, "data.train_files")
    val = _single(cfg.data.val_files, "data.val_files")
    wanted = {
        model_key: (model, (model / "config.json").is_file()),
        "data.train_files": (train, train.is_file()),
        "data.val_files": (val, val.is_file()),
    }
    _refuse_outside(cfg, {key: path for key, (path, done) in wanted.items() if not done})
    seed = getattr(cfg.data, "seed", None) or 0
    if not (model / "config.json").is_file():
        write_quickstart_model(model, seed=seed, tools=cfg.assets.task == "add")
        written.append(str(model))
    elif cfg.assets.task == "add":
        written += _refresh_template(model)
    a = cfg.assets
    for path, split, size in ((train, "train", a.train_size), (val, "test", a.val_size)):
        if path.is_file():
            continue
        records = make_records(size, task=a.task, length=a.task_length, seed=seed, split=split)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        write_parquet(records, tmp)
        tmp.replace(path)
        written.append(str(path))
    return written
