"""Start-up cost per call of the code sandbox: jaxrl's layers against bubblewrap's.

    python benchmarks/sandbox_startup.py [--calls 30]

Prints one JSON object: the median and mean wall seconds per call of `run_python("pass")` with
every layer; with the layers off one at a time (what each costs); a bare `python -I -B -c pass`
(the floor: an interpreter start); and, where `bwrap` is installed, bubblewrap running the same
interpreter in a comparable view (user, mount, network, PID, IPC namespaces; read-only binds of
the same paths; private /tmp, /dev, /proc; seccomp not included). Calls alternate between the
variants, so a change in the machine's load reaches them all alike; compare them as ratios
within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from jaxrl.agent.sandbox import default_read_paths, run_python

# The variants with a layer off run with allow_weaker_isolation: no warning per call here.
logging.getLogger("jaxrl.agent.sandbox").setLevel(logging.ERROR)

VARIANTS = {
    "all_layers": {},
    "no_filesystem_view": {"filesystem_view": False},
    "no_syscall_filter": {"syscall_filter": False},
    "no_landlock": {"landlock": False},
    "no_namespaces": {"namespaces": False},
}


def bwrap_argv(work: str) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--uid", "1000"]
    for path in default_read_paths():
        real = os.path.realpath(path)
        if os.path.islink(path):
            argv += ["--symlink", real, path]
        argv += ["--ro-bind", real, real]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", work, "/sandbox"]
    return [*argv, "--chdir", "/sandbox", sys.executable, "-I", "-B", "-c", "pass"]


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="jaxrl_bench_")
    calls = {
        name: (lambda kw=kw: run_python("pass", allow_weaker_isolation=True, **kw))
        for name, kw in VARIANTS.items()
    }
    calls["bare_python"] = lambda: subprocess.run([sys.executable, "-I", "-B", "-c", "pass"])
    if shutil.which("bwrap"):
        argv = bwrap_argv(work)
        subprocess.run(argv, check=True)
        calls["bwrap"] = lambda: subprocess.run(argv, check=True)
    times: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for _ in range(args.calls):
            for name, call in calls.items():
                times[name].append(timed(call))
    finally:
        shutil.rmtree(work)
    report = {
        name: {"median_s": statistics.median(t), "mean_s": statistics.fmean(t)}
        for name, t in times.items()
    }
    base = report["all_layers"]["median_s"]
    for name in report:
        report[name]["ratio_to_all_layers"] = report[name]["median_s"] / base
    print(json.dumps({"calls": args.calls, "variants": report}))


if __name__ == "__main__":
    main()
