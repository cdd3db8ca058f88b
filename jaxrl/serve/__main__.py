"""`python -m jaxrl.serve --model DIR | --checkpoint RUN`: a model served over the OpenAI API.

    python -m jaxrl.serve --model ~/.cache/jaxrl/quickstart_tools/model --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "model", "messages": [...]}'

Any OpenAI client then talks to it (`openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="none")`). The server is uvicorn running `jaxrl.serve.app`; the engine decodes every
pending request in each chunk (`--max-num-seqs` conversations at once).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import uvicorn

from jaxrl.serve import load, make_app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl.serve", description=__doc__.split("\n")[0]
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an HF model folder (config, weights, tokenizer)")
    source.add_argument(
        "--checkpoint",
        help="a run directory, its checkpoints folder or a "
        "step folder: the actor's weights (LoRA merged), the run's tokenizer",
    )
    parser.add_argument(
        "--served-model-name", help="the name clients ask for (default: the folder's)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="conversations decoded at once"
    )
    parser.add_argument(
        "--max-model-len", type=int, help="prompt + response tokens (default: the model's context)"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chunk", type=int, default=8, help="decode steps per engine pass")
    parser.add_argument("--max-pending", type=int, default=256, help="requests pending before 429")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds before 408")
    parser.add_argument("--seed", type=int, default=0, help="the key of requests without a seed")
    args = parser.parse_args(argv)
    served = load(
        args.model, checkpoint=args.checkpoint, name=args.served_model_name,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, chunk=args.chunk,
        max_pending=args.max_pending, request_timeout=args.request_timeout, seed=args.seed,
    )  # fmt: skip
    print(f"jaxrl.serve: {served.model} on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(make_app(served), host=args.host, port=args.port, log_level="warning")
    finally:
        served.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
