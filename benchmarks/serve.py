"""The OpenAI server against the engine's own batch call: tokens/s and the first-token
latency of 64 concurrent streaming clients (`jaxrl.serve`, `docs/serve.md`).

    python benchmarks/serve.py [--size S] [--clients 64] [--prompt 64] [--new 64] [--chunk 8]
                               [--warmup 5]

Workload model `--size` (float32) on one device, `--clients` random prompts of `--prompt`
token ids, each answered with exactly `--new` sampled tokens (temperature 1, `ignore_eos`),
three ways on the same engine (its `max_num_seqs` = `--clients`):

    batch      the engine's own batch call: `Scheduler.generate(fast=True)`, prefill and
               every decode step in one program
    slots      the same prompts as requests on the scheduler's slots (`fast=False`, decode
               chunks of `--chunk`): what the server runs, without HTTP
    server     uvicorn + the app on 127.0.0.1; in a process of their own, `--clients`
               `openai.AsyncOpenAI` clients at once, each streaming `/v1/completions`
               (token-id prompts)

One warm-up each (the server: `--warmup` runs), then the median of 3 runs. The server's
warm-up is longer: its clients arrive in a different pattern each run, and each new count of
requests admitted together (a bucket of rows) or decoded together compiles a program on
first use (the cost of the first run, `first_run_seconds`). Figures: tokens/s of each; the
server's overhead over each baseline (seconds / baseline's - 1; goal <= 0.20 over the batch
call); the server's first-token latency (seconds from the requests' start to each client's
first text chunk: p50, p90, max). The model has no tokenizer: a word-level one with a word
per id decodes the text. The clients' process and the server's share the host's cores. JSON
on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import emit, machine, median_seconds, workload_checkpoint


def id_tokenizer(vocab: int, folder: Path):
    """A word-level tokenizer whose id i is the word `t{i}` (id 0 the end token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="t1"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t0", unk_token="t1")
    fast.save_pretrained(str(folder))
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def clients_worker(args) -> None:
    """`--clients` streaming clients at once against the server on `--worker` (a port), on
    the benchmark's prompts: prints {"seconds", "first_token_s": [...]} as JSON."""
    import numpy as np
    import openai

    ids = np.random.RandomState(0).randint(3, 32000, (args.clients, args.prompt)).tolist()
    firsts: list[float] = []

    async def one(client, row: list[int], began: float) -> None:
        stream = await client.completions.create(
            model="bench", prompt=row, max_tokens=args.new, temperature=1.0, stream=True,
            extra_body={"ignore_eos": True})  # fmt: skip
        first = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - began
        firsts.append(first)

    async def all_clients() -> float:
        url = f"http://127.0.0.1:{args.worker}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                                      timeout=600) as client:  # fmt: skip
            began = time.perf_counter()
            await asyncio.gather(*(one(client, row, began) for row in ids))
            return time.perf_counter() - began

    seconds = asyncio.run(all_clients())
    print(json.dumps({"seconds": seconds, "first_token_s": firsts}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="S")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5, help="server runs before the 3 timed")
    parser.add_argument("--worker", type=int, help="(internal) run the clients against this port")
    args = parser.parse_args()
    if args.worker:
        return clients_worker(args)

    import jax
    import numpy as np
    import uvicorn

    import jaxrl.models as M
    from jaxrl.rollout import RolloutEngine, SamplingParams, Scheduler
    from jaxrl.serve import EngineLoop, Served, make_app

    config, params = M.from_pretrained(workload_checkpoint(args.size), dtype="float32")
    tokenizer = id_tokenizer(config.vocab_size, Path(tempfile.mkdtemp()))
    room = args.prompt + args.new + 1
    engine = RolloutEngine(config, max_num_seqs=args.clients, max_model_len=room,
                           tokenizer=tokenizer)  # fmt: skip
    engine.load_weights(params)
    ids = np.random.RandomState(0).randint(3, config.vocab_size, (args.clients, args.prompt))
    ids = ids.astype(np.int32)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.new, ignore_eos=True)
    tokens = args.clients * args.new

    def batch(fast: bool) -> None:
        scheduler = Scheduler(engine, chunk=None if fast else args.chunk)
        out = scheduler.generate(ids, np.ones_like(ids), sampling, jax.random.key(0), fast=fast)
        assert int(np.asarray(out.response_mask).sum()) == tokens
        jax.block_until_ready(out.log_probs)

    result = {}
    for name, fast in (("batch", True), ("slots", False)):
        seconds = median_seconds(lambda fast=fast: batch(fast))
        result[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds}
        print(name, result[name], flush=True)

    loop = EngineLoop(engine, chunk=args.chunk, max_pending=args.clients)
    served = Served(loop, tokenizer, "bench", engine.max_model_len, frozenset([0]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(served), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    runs = []

    def through_server() -> None:  # the clients in a process of their own
        sizes = ["--clients", str(args.clients), "--prompt", str(args.prompt), "--new",
                 str(args.new)]  # fmt: skip
        command = [sys.executable, __file__, "--worker", str(port), *sizes]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.splitlines()[-1]))

    for _ in range(args.warmup + 3):
        through_server()
    server.should_exit = True
    loop.close()
    median = sorted(runs[args.warmup :], key=lambda r: r["seconds"])[1]
    seconds, firsts = median["seconds"], median["first_token_s"]
    result["server"] = {
        "seconds": seconds,
        "first_run_seconds": runs[0]["seconds"],
        "tokens_per_s": tokens / seconds,
        "overhead_vs_batch": seconds / result["batch"]["seconds"] - 1,
        "overhead_vs_slots": seconds / result["slots"]["seconds"] - 1,
        "first_token_s": {
            "p50": statistics.median(firsts),
            "p90": statistics.quantiles(firsts, n=10)[-1],
            "max": max(firsts),
        },
    }
    emit({"benchmark": "serve", "size": args.size, "clients": args.clients,
          "prompt": args.prompt, "new": args.new, "chunk": args.chunk, "machine": machine(),
          **result})  # fmt: skip


if __name__ == "__main__":
    main()
