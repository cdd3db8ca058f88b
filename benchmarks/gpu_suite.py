"""One command that measures jaxrl on a CUDA GPU; `--dry-run` proves it on any CPU.

    bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR]      # the GPU machine (installs, runs this)
    python benchmarks/gpu_suite.py OUT_DIR [--only a,b] [--limit step=seconds] [--dry-run]

Every step runs in a child process (its own process group) under its own time limit, so a
hang, a crash or running out of device memory costs one step, never the suite, and appends
one JSON line to OUT_DIR/results.jsonl per measurement as soon as it is measured (a step cut
short keeps what it had). Each line carries the run id, the step, the device's
`peak_bytes_in_use` at that point (GPUs report it; every model is its own process, so the peak
is that measurement's) and its figures; stdout ends with a summary table. XLA's compilation
cache lives in OUT_DIR/jax_cache, so a step run again (`--only`) skips its compiles. The steps
and their limits (730 s in all; the whole suite took 321-365 s on one H200; `--limit` changes one):

    models       the workload checkpoints M and L written by transformers (torch, before JAX)
    env          devices, jax, measured copy bandwidth and bf16 matmul rate, the bf16 peak
    tests        pytest: the `gpu` marker and the Pallas kernel tests, compiled for real
    attention    A1: Pallas (two block shapes) and cuDNN, fwd and fwd+bwd, 2k-32k tokens, bf16
    decode-M/L/1.5B  W1 in bf16: tokens/s and the fraction of the HBM-bandwidth roof
    train-none/full  W2: the 1.5B shape at 4 x 2048 tokens, MFU, remat none / full
    grpo-L       W3 for model L in bf16: generation, log-probs and update seconds

`--dry-run` runs every step on the CPU with tiny shapes (model S for the checkpoint paths, the
Pallas kernels in the interpreter and lowered for CUDA, the GPU tests collected, not run), so
CI proves the suite is not broken between GPU runs. Figures of a dry run mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# bf16 dense tensor-core peak (FLOP/s) by device kind (substring, first match), from the
# vendors' data sheets: SXM parts (PCIe H100: 756e12).
BF16_PEAK = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
)

# The 1.5B shape: Qwen2.5-1.5B's (vocab 151936, tied embeddings).
QWEN_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    qkv_bias=True,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    tie_word_embeddings=True,
)


def bf16_peak(kind: str) -> float | None:
    """The bf16 dense peak of a device kind (None: not in the table, e.g. a CPU)."""
    return next((peak for name, peak in BF16_PEAK if name in kind), None)


def peak_bytes() -> int | None:
    """`peak_bytes_in_use` of device 0 so far (None where the backend does not report it)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def device_facts() -> dict[str, Any]:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "bf16_peak_flops": bf16_peak(device.device_kind),
    }


def copy_bandwidth(dry: bool) -> float:
    """HBM bytes/s of a device copy (bytes read + bytes written over the fastest of 7)."""
    import jax
    import jax.numpy as jnp
    from common import wall_seconds

    x = jnp.ones(((1 << 14) if dry else (1 << 30),), jnp.bfloat16)  # 2 GiB on a GPU
    copy = jax.jit(lambda x: x * 1)
    return 2 * x.nbytes / min(wall_seconds(lambda: copy(x).block_until_ready(), repeats=7))


def matmul_rate(dry: bool) -> float:
    """FLOP/s of an n^3 bf16 matmul (n = 8192; 256 in a dry run)."""
    import jax
    import jax.numpy as jnp
    from common import median_seconds

    n = 256 if dry else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / median_seconds(lambda: matmul(a, b).block_until_ready(), repeats=10)


# ------------------------------------------------------------------------------------ steps
# A step is a generator of records: each is written the moment it is yielded.

Records = Iterator[dict[str, Any]]


def step_models(dry: bool) -> Records:
    """The workload checkpoints (transformers in torch), made in a process of their own before
    any JAX step starts CUDA: the decode and GRPO steps only load them."""
    from common import workload_checkpoint

    for size in ("S",) if dry else ("M", "L"):
        start = time.perf_counter()
        yield {"model": size, "folder": str(workload_checkpoint(size)),
               "made_s": time.perf_counter() - start}  # fmt: skip


def step_env(dry: bool) -> Records:
    yield {
        **device_facts(),
        "copy_bytes_per_s": copy_bandwidth(dry),
        "bf16_matmul_flops": matmul_rate(dry),
    }


def step_tests(dry: bool, limit: float) -> Records:
    """The `gpu` marker and the Pallas kernel tests (compiled on a GPU) in a pytest child that
    writes to this step's log; float32 matmuls at full precision (Triton's default for a
    float32 dot is TF32, ~1e-3 off, while the tests compare float32 at 1e-5)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu" if dry else "cuda"}
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    files = ["tests/kernels/test_gpu.py", "tests/kernels/test_pallas_gpu.py"]
    # One process (no xdist: the GPU machine lacks it, and one GPU is not to be shared).
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
               "addopts=-ra --strict-markers",
               "-m", "gpu or not gpu", *files, *(["--collect-only"] if dry else [])]  # fmt: skip
    junit = Path(tempfile.mkdtemp()) / "tests.xml"
    code = run_group([*command, "--junitxml", str(junit)], env, timeout=limit - 10, cwd=ROOT)
    yield {"returncode": code, **_junit_counts(junit)}
    if code != 0:
        raise SystemExit(f"pytest exited {code}")


def _junit_counts(path: Path) -> dict[str, Any]:
    """Test counts from pytest's JUnit XML (empty when it wrote none)."""
    if not path.exists():
        return {}
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def step_attention(dry: bool) -> Records:
    """A1 on the GPU: Pallas (block 64x64 and 128x64) and cuDNN, bf16, each as a fraction of
    the bf16 peak; on a CPU the kernels run in the interpreter at 64 tokens and are lowered
    for CUDA."""
    import jax
    from attention_gpu import cudnn_figures, pallas_figures, random_inputs

    peak = bf16_peak(jax.devices()[0].device_kind)
    for t in (64,) if dry else (2048, 8192, 16384, 32768):
        q, k, v, dout = random_inputs(t)
        if dry:
            _lower_for_cuda(q, k, v)
        best = None
        for bq, bk in ((64, 64), (128, 64)):
            figures = pallas_figures(q, k, v, dout, bq, bk, interpret=dry)
            out = figures.pop("out")
            yield {"t": t, "impl": "pallas", **figures, **_of_peak(figures, peak)}
            if best is None or figures["fwd_bwd_tflops"] > best["fwd_bwd_tflops"]:
                best = figures
        if dry:
            continue
        cudnn = cudnn_figures(q, k, v, dout, pallas_out=out)
        if "cudnn_fwd_bwd_tflops" in cudnn:
            cudnn["pallas_of_cudnn_fwd_bwd"] = (
                best["fwd_bwd_tflops"] / cudnn["cudnn_fwd_bwd_tflops"]
            )
        yield {"t": t, "impl": "cudnn", **cudnn, **_of_peak(cudnn, peak, "cudnn_")}


def _of_peak(figures: dict, peak: float | None, prefix: str = "") -> dict:
    """`*_tflops` figures as fractions of the bf16 peak (none without a peak)."""
    if not peak:
        return {}
    return {
        f"{prefix}{kind}_of_peak": figures[f"{prefix}{kind}_tflops"] * 1e12 / peak
        for kind in ("fwd", "fwd_bwd")
        if f"{prefix}{kind}_tflops" in figures
    }


def _lower_for_cuda(q, k, v) -> None:
    """The Pallas forward and backward lowered to CUDA (Triton) without a GPU."""
    import jax
    import jax.numpy as jnp

    from jaxrl.kernels.pallas_gpu import pallas_attention

    def loss(q, k, v):
        out, _ = pallas_attention(q, k, v, causal=True, scale=0.125)
        return jnp.sum(out.astype(jnp.float32))

    for fn in (loss, jax.grad(loss, (0, 1, 2))):
        jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",))


def _decode(dry: bool, size: str) -> Records:
    """W1 in bf16: 16 prompts x 64 tokens, 128 sampled tokens each (8 dry). The peak memory
    is read before the bandwidth probe, which allocates 4 GiB of its own."""
    import jax
    from generate import bench_engine, with_roof

    import jaxrl.models as M

    if size == "1.5B":
        shape = TINY if dry else QWEN_1_5B
        config = M.DecoderConfig(model_type="qwen2", param_dtype="bfloat16", **shape)
        params = jax.jit(lambda key: M.init_params(config, key))(jax.random.key(0))
    else:
        from common import workload_checkpoint

        folder = workload_checkpoint("S" if dry else size)
        config, params = M.from_pretrained(folder, dtype="bfloat16")
    # dry: 32 tokens, so that the decode steps outweigh the prefill that the decode step's
    # time is derived without (total - prefill); with 8 a loaded CPU's noise made it negative
    figures = bench_engine(config, params, "bfloat16", None, new=32 if dry else 128)
    peak = peak_bytes()
    del params
    bandwidth = copy_bandwidth(dry)
    name = size if not dry else "tiny" if size == "1.5B" else "S"  # what actually ran
    yield {"model": name, "peak_bytes_in_use": peak, "bandwidth_bytes_per_s": bandwidth,
           **with_roof(figures, bandwidth)}  # fmt: skip


def step_decode_memory(dry: bool) -> Records:
    """The generation program's compiled peak (argument + temp bytes) against params + KV
    cache, W1's shapes, bf16, XLA decode backend (model L; S dry): the goal is <= 1.10."""
    from generate_memory import measure

    size = "S" if dry else "L"
    yield {"model": size, **measure(size, "bfloat16", "xla")}


def _train(dry: bool, remat: str) -> Records:
    """W2 on the GPU: the 1.5B shape, 4 x 2048 tokens (tiny 2 x 64 dry), fp32 master weights,
    bf16 compute, the actor's update; MFU = 6 * N * tokens / step / bf16 peak (attention's
    own FLOPs not counted: about 6% more at 2k tokens for this shape)."""
    import jax
    from train_step import bench_train_step

    import jaxrl.models as M

    config = M.DecoderConfig(
        model_type="qwen2", param_dtype="float32", dtype="bfloat16", remat=remat,
        **(TINY if dry else QWEN_1_5B),
    )  # fmt: skip
    rows, length = (2, 64) if dry else (4, 2048)
    figures = bench_train_step(config, rows=rows, length=length, prompt=16 if dry else 64)
    yield {"model": "tiny" if dry else "1.5B", "remat": remat, **figures,
           **mfu(figures, bf16_peak(jax.devices()[0].device_kind))}  # fmt: skip


# A mixture of experts of Qwen3-30B-A3B's proportions at half its width: 64 experts of
# intermediate 384, 8 per token, 12 layers (1.1B parameters, 0.33B active per token).
MOE_1B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=12, num_heads=16,
    num_kv_heads=4, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    moe_intermediate_size=384,
)  # fmt: skip


def step_train_moe(dry: bool) -> Records:
    """W2 for an MoE shape in bf16 (`MOE_1B`, 4 x 2048 tokens; a tiny one dry), its grouped
    expert matmuls as XLA's `ragged_dot` and as blocks of rows (`moe.grouped_matmul`), in
    the same process: step seconds, MFU over the active parameters (`parameter_counts`)."""
    import os

    import jax
    from train_step import bench_train_step

    import jaxrl.models as M
    from jaxrl.models.moe import GROUPED_MATMUL_ENV, MoeSpec

    shape = dict(TINY, moe_intermediate_size=32) if dry else MOE_1B
    spec = MoeSpec(num_experts=8 if dry else 64, top_k=2 if dry else 8, norm_topk_prob=True)
    config = M.DecoderConfig(model_type="qwen3_moe", param_dtype="float32", dtype="bfloat16",
                             remat="full", moe=spec, **shape)  # fmt: skip
    rows, length = (2, 64) if dry else (4, 2048)
    for method in ("blocks", "ragged_dot"):
        os.environ[GROUPED_MATMUL_ENV] = method
        figures = bench_train_step(config, rows=rows, length=length, prompt=16 if dry else 64)
        yield {"model": "tiny-moe" if dry else "MoE-1B", "grouped_matmul": method, **figures,
               **mfu(figures, bf16_peak(jax.devices()[0].device_kind))}  # fmt: skip
    os.environ.pop(GROUPED_MATMUL_ENV)


def mfu(figures: dict, peak: float | None) -> dict:
    """{"mfu": FLOPs per second of the step over the peak} (empty without a peak)."""
    return {"mfu": figures["flops"] / figures["step_s"] / peak} if peak else {}


def step_grpo(dry: bool) -> Records:
    """W3 for model L in bf16, the update split in two mini-batches so that the step runs
    the old-log-prob pass too (a dry run: model S, 4 prompts, 8 tokens)."""
    from common import workload_checkpoint
    from grpo_step import bench_jaxrl

    folder = workload_checkpoint("S" if dry else "L")
    small = dict(prompts=4, new=8, steps=2) if dry else {}
    figures = bench_jaxrl(folder, None, dtype="bfloat16", mini_batches=2, **small)
    yield {"model": "S" if dry else "L", "mini_batches": 2, **figures}


STEPS: dict[str, tuple[int, Callable[..., Records]]] = {  # name: (seconds, step)
    "models": (40, step_models),
    "env": (25, step_env),
    "tests": (140, step_tests),
    "attention": (55, step_attention),
    "decode-M": (70, lambda dry: _decode(dry, "M")),
    "decode-L": (80, lambda dry: _decode(dry, "L")),
    "decode-1.5B": (80, lambda dry: _decode(dry, "1.5B")),
    "decode-memory": (50, step_decode_memory),
    "train-none": (50, lambda dry: _train(dry, "none")),
    "train-full": (50, lambda dry: _train(dry, "full")),
    "train-moe": (70, step_train_moe),
    "grpo-L": (90, step_grpo),
}  # 800 s in all
DRY_SCALE = 3  # a dry run's limits: a loaded 2-core CI machine, not an H100


# ------------------------------------------------------------------------------- the runner


def run_group(command: list[str], env: dict, timeout: float, *, cwd=None, log=None) -> int:
    """Run `command` in its own process group (output to the file `log`, else inherited);
    on timeout the whole group is killed, so no JAX grandchild keeps the GPU. Returns the
    exit code, 124 on timeout."""
    sys.stdout.flush()
    proc = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT if log else None)  # fmt: skip
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def run_step(name: str, out_dir: Path, dry: bool, limit: float) -> None:
    """In the child: run one step, appending each record to results.jsonl as it comes."""
    step = STEPS[name][1]
    start = time.perf_counter()
    records = step(dry, limit) if name == "tests" else step(dry)
    for record in records:
        line = {"run": os.environ.get("JAXRL_SUITE_RUN"), "step": name, "dry_run": dry}
        line.update({"peak_bytes_in_use": peak_bytes(), **record})
        line["step_elapsed_s"] = time.perf_counter() - start
        with open(out_dir / "results.jsonl", "a") as f:
            f.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        print(line, flush=True)


def run_child(name: str, out_dir: Path, dry: bool, limit: float, env: dict) -> dict[str, Any]:
    """One step in a child process under its time limit; what became of it."""
    command = [sys.executable, __file__, str(out_dir), "--step", name, "--limit",
               f"{name}={limit}"] + (["--dry-run"] if dry else [])  # fmt: skip
    log = out_dir / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        code = run_group(command, env, timeout=limit, log=f)
    if code == 0:
        status = "ok"
    elif code == 124:
        status = f"timed out after {limit:g} s (see {log.name})"
    else:
        status = f"failed (exit {code}, see {log.name})"
    return {"step": name, "status": status, "seconds": round(time.perf_counter() - start, 1)}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The lines of results.jsonl that parse (a child killed mid-write leaves half a line)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summary(out_dir: Path, outcomes: list[dict], run: str | None = None) -> str:
    """A table of every step's outcome and its headline figures (this run's records)."""
    records: dict[str, list[dict]] = {}
    for r in read_records(out_dir / "results.jsonl"):
        if run is None or r.get("run") == run:
            records.setdefault(r["step"], []).append(r)
    keys = (
        "tokens_per_s", "fraction_of_roofline", "mfu", "step_s", "generation_s",
        "log_prob_s", "update_s", "fwd_bwd_tflops", "fwd_bwd_of_peak", "cudnn_fwd_bwd_tflops",
        "pallas_of_cudnn_fwd_bwd", "copy_bytes_per_s", "bf16_matmul_flops", "tests",
        "failures", "errors", "peak_over_params_and_kv",
    )  # fmt: skip
    lines = [f"{'step':<12} {'status':<34} {'s':>6}  figures"]
    for o in outcomes:
        for r in records.get(o["step"], [{}]):
            shown = {k: r[k] for k in keys if r.get(k) is not None}
            tag = " ".join(str(r[k]) for k in ("t", "impl", "model", "remat") if k in r)
            if r.get("peak_bytes_in_use"):
                shown["peak_GiB"] = r["peak_bytes_in_use"] / 2**30
            figures = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            )
            head = f"{o['step']:<12} {o['status'][:34]:<34} {o['seconds']:>6}"
            lines.append(f"{head}  {tag} {figures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    parser.add_argument(
        "--limit", action="append", default=[], metavar="STEP=SECONDS",
        help="another time limit for a step (repeatable)",
    )  # fmt: skip
    parser.add_argument("--step", help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(HERE), str(ROOT)]
    limits = {name: float(seconds) * (DRY_SCALE if args.dry_run else 1)
              for name, (seconds, _) in STEPS.items()}  # fmt: skip
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in STEPS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--limit {item}: expected STEP=SECONDS with a step of {list(STEPS)}")
        limits[name] = float(seconds)
    if args.step:
        run_step(args.step, out_dir, args.dry_run, limits[args.step])
        return 0
    names = args.only.split(",") if args.only else list(STEPS)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    run = time.strftime("%Y%m%dT%H%M%S")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAXRL_SUITE_RUN": run}
    cache = str(out_dir / "jax_cache")
    if args.dry_run:
        # One CPU device whatever the caller's count (a test session asks for 8); the caller's
        # other flags and compilation cache (a test session's) are kept.
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
        cache = env.get("JAX_COMPILATION_CACHE_DIR", cache)
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    outcomes = []
    for name in names:
        outcomes.append(run_child(name, out_dir, args.dry_run, limits[name], env))
        print(f"{name}: {outcomes[-1]['status']} in {outcomes[-1]['seconds']} s", flush=True)
    table = summary(out_dir, outcomes, run)
    (out_dir / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 0 if all(o["status"] == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
