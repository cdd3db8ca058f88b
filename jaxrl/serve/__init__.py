"""An OpenAI-compatible server over the rollout engine (`python -m jaxrl.serve`).

    served = load(model_dir, max_num_seqs=64)          # the engine, its thread, the tokenizer
    app = make_app(served)                             # Starlette: /v1/chat/completions, ...
    served.engine.close()

`protocol` reads OpenAI's requests and writes its errors; `engine_loop` runs the engine's
scheduler on a thread of its own; `app` is the HTTP API (its module doc lists the routes and
the errors); `recorder` records an episode's calls and chains them into training sequences;
`external` runs a trainer's rollout phase of a user's agent (`Episode` is what the agent's
function gets); `background` runs uvicorn on a thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

import jaxrl.models as M
from jaxrl.data import load_tokenizer
from jaxrl.export import read_actor, resolve_step
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.serve.app import Served, make_app
from jaxrl.serve.engine_loop import EngineLoop
from jaxrl.serve.external import Episode, ExternalAgents
from jaxrl.serve.protocol import ApiError
from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh

__all__ = ["ApiError", "EngineLoop", "Episode", "ExternalAgents", "Served", "load", "make_app"]


def load(
    model: str | os.PathLike | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
    name: str | None = None,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "float32",
    chunk: int = 8,
    max_pending: int = 256,
    request_timeout: float = 600.0,
    seed: int = 0,
) -> Served:
    """An HF model folder (`model`), or the actor of a run's checkpoint (`checkpoint`: a run
    directory, its checkpoints folder or a step folder; a LoRA run's adapters on its base,
    the tokenizer of the folder it trained from), on the rollout mesh (dp = the devices /
    tp), served as `name` (default: the model folder's name, or `{run}-step{N}`)."""
    if (model is None) == (checkpoint is None):
        raise ValueError(
            "serve one of: an HF model folder (--model) or a checkpoint (--checkpoint)"
        )
    if checkpoint is not None:
        config, params, folder, _ = read_actor(checkpoint, merge=True)
        config = config.replace(param_dtype=dtype, dtype=dtype)
        checkpoints, step = resolve_step(Path(checkpoint))
        name = name or f"{checkpoints.parent.name}-step{step}"
    else:
        folder = Path(model).expanduser()
        config, params = M.from_pretrained(folder, dtype=dtype)
    layout = Layout.create(rollout_mesh(tensor_parallel_size), ROLLOUT_RULES)
    tokenizer = load_tokenizer(str(folder))
    engine = RolloutEngine(config, layout, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, tokenizer=tokenizer)  # fmt: skip
    engine.load_weights(params)
    del params
    jax.block_until_ready(engine.weights.params)
    loop = EngineLoop(engine, chunk=chunk, max_pending=max_pending, seed=seed)
    return Served(loop, tokenizer, name or folder.name, engine.max_model_len,
                  frozenset(config.eos_token_id), request_timeout)  # fmt: skip
