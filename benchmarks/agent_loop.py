"""Multi-turn agent rollouts: jaxrl's `AgentLoop` (tools overlap decoding) against a
turn-by-turn baseline in which every tool call blocks the batch.

    python benchmarks/agent_loop.py [--trajectories 64] [--turns 4] [--min-delay 0.05]
        [--max-delay 0.5] [--seed 0] [--decode-chunk 16] [--repeats 2]

Workload: `--trajectories` requests (one user message each, `add: a + b`, seeded) of up to
`--turns` assistant turns. The policy is `jaxrl.testing.scripted`'s model (one-hot
embeddings, hidden size = the tool tokenizer's vocabulary, a lookup-table LM head, attention
and MLP live at `--live` times their random init, so the context and the KV cache matter),
whose every turn is a calculator call (6 sampled tokens), so every trajectory runs to the
turn limit: `turns` turns, `turns - 1` tool calls (`assistant_turns` and `tool_calls` in the
JSON say so; with a large `--live` and a large vocabulary the random attention and MLP
outputs outweigh the script and many turns end without a call). The tool answers "7" after
sleeping a delay drawn uniformly from [min-delay, max-delay] per (trajectory, call), from
`--seed`: both modes wait the same delays for the same calls. Sampling at temperature 1,
turn t of request i with `fold_in(fold_in(key, i), t)` in both modes, so both sample the
same tokens (checked: `same_tokens` compares every trajectory's response ids and loss mask
across all runs; `max_log_prob_diff` their log-probs).

    loop       `AgentLoop.run`: all trajectories in the engine's slots, decoded
               `--decode-chunk` tokens at a time; a finished turn's call goes to the
               `ToolRunner` (one thread per trajectory) and the other slots keep decoding.
    baseline   turn by turn: decode every active trajectory's turn to its end
               (`engine.decode` without `max_steps`), then run the turn's tool calls one
               after another (each blocks), then append the answers, then the next turn.

Figures per mode: wall seconds (`seconds`), policy tokens/s (sampled tokens / wall time),
the seconds and fraction of wall time the decoder waited for tools (`wait_seconds`: the
loop's `LoopStats.wait_seconds`, the time nothing could decode; the baseline's whole tool
phase), and the time in the engine (`decode_seconds`). `speedup` is the baseline's wall time
over the loop's (= the ratio of tokens/s, the work being the same). For scale:
`tool_seconds_total` (the delays of all calls that ran: about the baseline's wait) and
`critical_path_tool_s` (the longest trajectory's delays summed: a floor under the loop's wall
time, which also holds that trajectory's decoding).

Warm-up (untimed): each mode once with instant tools, and the engine's append program at
every row bucket the loop can use. Then the loop `--repeats` times and the baseline
`--baseline-repeats` times (default once: it is mostly sleeping, ~55 s at the defaults),
the fastest of each reported. JSON on the last line, with the cores other processes kept
busy meanwhile (`other_processes_cores`; the machine is shared).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import tempfile
import time

from common import emit, machine
from generate import busy_seconds, other_processes_cores

RESPONSE_LENGTH = 128  # a trajectory takes ~50 (4 turns x 6 sampled + 3 tool turns)
MAX_PROMPT_LENGTH = 64


def delayed_calculator(delays):
    """The calculator (any expression answers "7") after `delays[i, k]` seconds on the k-th
    call of trajectory i (its `create_kwargs["trajectory"]`), in a plain (threaded)
    `execute`."""
    from jaxrl.agent.tools.base import ToolResponse
    from jaxrl.agent.tools.calculator import Calculator

    class DelayedCalculator(Calculator):
        def __init__(self):
            super().__init__({})
            self.delays = delays
            self.calls: collections.Counter = collections.Counter()

        async def create(self, instance_id=None, create_kwargs=None, **kwargs):
            i = int((create_kwargs or {})["trajectory"])
            k = self.calls[i]  # on the runner's event loop: one create at a time
            self.calls[i] += 1
            return f"{i}:{k}", ToolResponse()

        def execute(self, instance_id, parameters, **kwargs):  # plain, not async
            i, k = (int(x) for x in instance_id.split(":"))
            time.sleep(float(self.delays[i, k]))
            return ToolResponse(text="7"), 0.0, {}

    return DelayedCalculator()


@dataclasses.dataclass
class Run:
    """One mode's run: its trajectories and figures."""

    trajectories: list
    seconds: float
    wait_seconds: float
    decode_seconds: float
    decode_calls: int

    def figures(self) -> dict:
        tokens = sampled_tokens(self.trajectories)
        return {
            "seconds": self.seconds,
            "tokens_per_s": tokens / self.seconds,
            "wait_seconds": self.wait_seconds,
            "wait_fraction": self.wait_seconds / self.seconds,
            "decode_seconds": self.decode_seconds,
            "decode_calls": self.decode_calls,
        }


def sampled_tokens(trajectories) -> int:
    return sum(sum(t.sampled) for t in trajectories)


def run_loop(engine, chat, runner, limits, requests, sampling, rng) -> Run:
    from jaxrl.agent import AgentLoop

    loop = AgentLoop(
        engine,
        chat,
        runner,
        limits,
        response_length=RESPONSE_LENGTH,
        max_prompt_length=MAX_PROMPT_LENGTH,
    )
    out = loop.run(requests, sampling, rng)
    s = loop.stats
    return Run(out, s.seconds, s.wait_seconds, s.decode_seconds, s.decode_calls)


def run_baseline(engine, chat, runner, limits, requests, sampling, rng) -> Run:
    """The same work turn by turn (see the module doc), with the loop's limits and its
    per-turn keys."""
    import jax
    import numpy as np

    from jaxrl.agent.loop import Trajectory
    from jaxrl.agent.parser import parse_hermes
    from jaxrl.data.templates import left_pad

    @jax.jit
    def turn_keys(index, turn):  # AgentLoop's: fold_in(fold_in(rng, i), t)
        return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(rng, i), turn))(index)

    sampling = dataclasses.replace(sampling, n=1, max_tokens=RESPONSE_LENGTH)
    schemas = list(runner.schemas.values())
    engine_seconds, wait, calls = 0.0, 0.0, 0
    start = time.perf_counter()
    prompts = [chat.prompt(r.messages, schemas) for r in requests]
    ids, mask = left_pad(prompts, max(len(p) for p in prompts), 0)
    t0 = time.perf_counter()
    slots = [int(s) for s in engine.start(ids, mask)]
    engine_seconds += time.perf_counter() - t0
    records = [
        Trajectory(prompt=p, messages=[dict(m) for m in r.messages])
        for p, r in zip(prompts, requests, strict=True)
    ]
    open_slots = set(slots)
    active = list(range(len(requests)))
    try:
        for turn in range(limits.max_assistant_turns):
            if not active:
                break
            keys = turn_keys(np.asarray(active, np.uint32), np.uint32(turn))
            t0 = time.perf_counter()
            out = engine.decode([slots[i] for i in active], sampling, keys)
            engine_seconds += time.perf_counter() - t0
            calls += 1
            pending = []  # (trajectory, its tool calls)
            for i, tokens, log_probs, reason in zip(
                active, out.tokens, out.log_probs, out.finish_reasons, strict=True
            ):
                record = records[i]
                over = len(record.response) + len(tokens) >= RESPONSE_LENGTH
                record.add_turn(tokens.tolist(), log_probs.tolist())
                text = chat.text(tokens.tolist())
                record.messages.append({"role": "assistant", "content": text})
                tool_calls = parse_hermes(text)[1][: limits.max_parallel_calls]
                if over or reason != "stop" or turn + 1 >= limits.max_assistant_turns:
                    record.finish = "length" if over or reason != "stop" else "turns"
                elif not tool_calls:
                    record.finish = "stop"
                else:
                    pending.append((i, tool_calls))
                    continue
                engine.end([slots[i]])
                open_slots.discard(slots[i])
            t0 = time.perf_counter()
            answers = []  # every call blocks: one after another
            for i, tool_calls in pending:
                kwargs = (requests[i].tools_kwargs.get("calculator") or {}).get("create_kwargs")
                answers.append([runner.submit(c, kwargs).result() for c in tool_calls])
            wait += time.perf_counter() - t0
            active, token_lists = [], []
            for (i, tool_calls), results in zip(pending, answers, strict=True):
                record = records[i]
                record.tool_calls += len(tool_calls)
                record.tool_seconds += sum(r.seconds for r in results)
                messages = [{"role": "tool", "content": r.text} for r in results]
                tool_ids = chat.after_turn(record.messages, messages, schemas)
                record.messages += messages
                if len(record.response) + len(tool_ids) >= RESPONSE_LENGTH:
                    record.finish = "length"
                    engine.end([slots[i]])
                    open_slots.discard(slots[i])
                    continue
                record.add_tool_turn(tool_ids)
                active.append(i)
                token_lists.append(tool_ids)
            if active:
                t0 = time.perf_counter()
                engine.append([slots[i] for i in active], token_lists)
                engine_seconds += time.perf_counter() - t0
    finally:
        if open_slots:
            engine.end(sorted(open_slots))
    return Run(records, time.perf_counter() - start, wait, engine_seconds, calls)


def compile_appends(engine, chat, schemas, trajectories: int) -> None:
    """Compile the engine's append program at every row bucket the loop may use (it appends
    the tool turns of however many calls finished together), for a tool turn's length."""
    from jaxrl.data import bucket
    from jaxrl.data.templates import left_pad

    messages = [{"role": "user", "content": "add: 1 + 2"}]
    prompt = chat.prompt(messages, schemas)
    turn = chat.after_turn(
        [*messages, {"role": "assistant", "content": "x"}],
        [{"role": "tool", "content": "7"}],
        schemas,
    )
    for rows in sorted({bucket(n, 1) for n in range(1, trajectories + 1)}):
        ids, mask = left_pad([prompt] * rows, len(prompt), 0)
        slots = [int(s) for s in engine.start(ids, mask)]
        engine.append(slots, [turn] * rows)
        engine.end(slots)


def same_work(runs: list[Run]) -> tuple[bool, float]:
    """Whether every run sampled and appended the same tokens as the first, and the largest
    log-prob difference from it."""
    import numpy as np

    first, same, diff = runs[0].trajectories, True, 0.0
    for run in runs[1:]:
        for a, b in zip(first, run.trajectories, strict=True):
            if a.response != b.response or a.sampled != b.sampled:
                same = False
                continue
            d = np.abs(np.asarray(a.log_probs) - np.asarray(b.log_probs))
            diff = max(diff, float(d.max(initial=0.0)))
    return same, diff


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="assistant turns per trajectory")
    parser.add_argument("--min-delay", type=float, default=0.05, help="tool call seconds, min")
    parser.add_argument("--max-delay", type=float, default=0.5, help="tool call seconds, max")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-chunk", type=int, default=16, help="the loop's decode steps")
    parser.add_argument("--weight", type=float, default=30.0, help="the script token's logit")
    parser.add_argument("--live", type=float, default=0.1, help="attention/MLP scale")
    parser.add_argument("--repeats", type=int, default=2, help="timed loop runs (best kept)")
    parser.add_argument("--baseline-repeats", type=int, default=1, help="timed baseline runs")
    args = parser.parse_args()
    start = busy_seconds(), sum(os.times()[:4]), time.perf_counter()

    import jax
    import numpy as np

    from jaxrl.agent import AgentRequest, ChatTokens, Limits, ToolRunner
    from jaxrl.data import load_tokenizer, synthetic
    from jaxrl.rollout import RolloutEngine, SamplingParams
    from jaxrl.testing.scripted import calculator_chain, scripted_policy

    with tempfile.TemporaryDirectory(prefix="jaxrl_agent_bench_") as folder:
        synthetic.write_tokenizer(folder, tools=True)
        tokenizer = load_tokenizer(folder)
    config, params = scripted_policy(
        tokenizer, calculator_chain(), weight=args.weight, live=args.live, seed=args.seed
    )
    n = args.trajectories
    engine = RolloutEngine(
        config,
        None,
        max_num_seqs=n,
        max_model_len=MAX_PROMPT_LENGTH + RESPONSE_LENGTH + 64,
        tokenizer=tokenizer,
    )
    engine.load_weights(params)
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    limits = Limits(max_assistant_turns=args.turns, decode_chunk=args.decode_chunk)
    sampling = SamplingParams(temperature=1.0, max_tokens=RESPONSE_LENGTH)
    rng = jax.random.key(args.seed)
    numbers = np.random.default_rng(args.seed).integers(1, 1000, (n, 2))
    requests = [
        AgentRequest(
            [{"role": "user", "content": f"add: {a} + {b}"}],
            "tool_agent",
            {"calculator": {"create_kwargs": {"trajectory": i}}},
        )
        for i, (a, b) in enumerate(numbers)
    ]
    delays = np.random.default_rng([args.seed, 1]).uniform(
        args.min_delay, args.max_delay, (n, args.turns)
    )
    tool = delayed_calculator(delays)
    modes = {"loop": run_loop, "baseline": run_baseline}
    repeats = {"loop": args.repeats, "baseline": args.baseline_repeats}
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    with ToolRunner({"calculator": tool}, workers=n) as runner:
        warm_start = time.perf_counter()
        tool.delays = np.zeros_like(delays)  # warm-up: instant tools
        for fn in modes.values():
            tool.calls.clear()
            fn(engine, chat, runner, limits, requests, sampling, rng)
        compile_appends(engine, chat, list(runner.schemas.values()), n)
        warm_seconds = time.perf_counter() - warm_start
        tool.delays = delays
        for mode, fn in modes.items():
            for _ in range(repeats[mode]):
                tool.calls.clear()
                runs[mode].append(fn(engine, chat, runner, limits, requests, sampling, rng))
                print(mode, runs[mode][-1].figures(), flush=True)
    same, log_prob_diff = same_work([*runs["loop"], *runs["baseline"]])
    best = {m: min(r, key=lambda run: run.seconds) for m, r in runs.items()}
    trajectories = best["loop"].trajectories
    calls = np.zeros((n, args.turns), bool)  # the calls that ran (not those malformed)
    for i, count in tool.calls.items():
        calls[i, :count] = True
    emit(
        {
            "workload": "agent_loop",
            "trajectories": n,
            "turns": args.turns,
            "min_delay": args.min_delay,
            "max_delay": args.max_delay,
            "seed": args.seed,
            "decode_chunk": args.decode_chunk,
            "response_length": RESPONSE_LENGTH,
            "policy": {
                "weight": args.weight,
                "live": args.live,
                "vocab": config.vocab_size,
                "hidden": config.hidden_size,
                "layers": config.num_layers,
            },
            "sampled_tokens": sampled_tokens(trajectories),
            "assistant_turns": sum(t.assistant_turns for t in trajectories),
            "tool_calls": int(calls.sum()),
            "tool_seconds_total": float((delays * calls).sum()),
            "critical_path_tool_s": float((delays * calls).sum(axis=1).max()),
            "warmup_s": warm_seconds,
            "loop": best["loop"].figures(),
            "baseline": best["baseline"].figures(),
            "runs_s": {m: [r.seconds for r in rs] for m, rs in runs.items()},
            "speedup": best["baseline"].seconds / best["loop"].seconds,
            "tokens_per_s_ratio": best["loop"].figures()["tokens_per_s"]
            / best["baseline"].figures()["tokens_per_s"],
            "same_tokens": same,
            "max_log_prob_diff": log_prob_diff,
            "other_processes_cores": other_processes_cores(*start),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
