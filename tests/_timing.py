"""Where the suite's time goes: wall and compile seconds per test file, printed at the end.

Each test's JAX compile work in this process (tracing to a jaxpr, lowering to MLIR, XLA's
backend compile) and the persistent compilation cache's hits and misses are read from
`jax.monitoring` events and attached to the test's report (`user_properties`, so they reach
xdist's controller and `--junitxml`). The terminal summary lists the files by wall time with
their compile share; `JAXRL_TEST_TIMING=FILE` also writes every test's figures as JSON.
Compiles inside subprocesses that a test starts (the multi-process and CLI tests) are not
seen here: their wall time counts, their compile time does not.
"""

from __future__ import annotations

import collections
import json
import os

import jax.monitoring
import pytest

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_COUNTS = {
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}
_current: collections.Counter = collections.Counter()
_by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_by_test: dict[str, dict] = {}
_programs: collections.Counter = collections.Counter()  # XLA compile seconds per function name
_program_counts: collections.Counter = collections.Counter()


def _on_duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
    if event in _EVENTS:
        _current[_EVENTS[event]] += seconds
    if _EVENTS.get(event) == "compile_s":
        _programs[fun_name] += seconds
        _program_counts[fun_name] += 1


def _on_event(event: str, **_) -> None:
    if event in _COUNTS:
        _current[_COUNTS[event]] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":  # setup, call and teardown: the test's whole compile work
        outcome.get_result().user_properties.extend(sorted(_current.items()))


def pytest_runtest_logreport(report):
    """Runs where the reports are gathered (xdist's controller, or the one process)."""
    path = report.nodeid.split("::", 1)[0]
    row = _by_file[path]
    row["wall_s"] += report.duration
    test = _by_test.setdefault(report.nodeid, {"file": path, "wall_s": 0.0})
    test["wall_s"] += report.duration  # setup, call and teardown
    if report.when == "setup":  # every test has one, a skipped test too
        row["tests"] += 1
    if report.when == "teardown":
        props = dict(report.user_properties)
        for key in (*_EVENTS.values(), *_COUNTS.values()):
            row[key] += props.get(key, 0)
        test.update(props)


def pytest_sessionfinish(session):
    """Each process (each xdist worker too) writes its compile seconds per program name to
    `JAXRL_TEST_PROGRAMS`.<pid> when that variable is set."""
    target = os.environ.get("JAXRL_TEST_PROGRAMS")
    if target and _programs:
        rows = {name: [round(s, 3), _program_counts[name]] for name, s in _programs.items()}
        with open(f"{target}.{os.getpid()}", "w") as f:
            json.dump(rows, f, indent=0, sort_keys=True)


def pytest_terminal_summary(terminalreporter):
    if not _by_file or hasattr(terminalreporter.config, "workerinput"):
        return
    rows = sorted(_by_file.items(), key=lambda kv: -kv[1]["wall_s"])
    total = sum(r["wall_s"] for _, r in rows)
    compile_total = sum(r["trace_s"] + r["lower_s"] + r["compile_s"] for _, r in rows)
    write = terminalreporter.write_line
    terminalreporter.section("time per file (wall; compile = trace + lower + XLA compile)")
    write(f"{'wall s':>8} {'compile s':>9} {'hits':>6} {'misses':>6} {'tests':>5}  file")
    for path, r in rows[:30]:
        compile_s = r["trace_s"] + r["lower_s"] + r["compile_s"]
        write(f"{r['wall_s']:8.1f} {compile_s:9.1f} {r['cache_hits']:6d} "
              f"{r['cache_misses']:6d} {r['tests']:5d}  {path}")  # fmt: skip
    write(f"{total:8.1f} {compile_total:9.1f}  all {len(rows)} files (summed over workers)")
    target = os.environ.get("JAXRL_TEST_TIMING")
    if target:
        with open(target, "w") as f:
            json.dump({"files": _by_file, "tests": _by_test}, f, indent=1, sort_keys=True)


def markdown(figures: dict, before: dict | None = None) -> str:
    """The per-file table of docs/testing.md from `JAXRL_TEST_TIMING` JSON (`before`: an
    earlier run's, for a column of its wall times)."""
    old = (before or {}).get("files", {})
    rows = sorted(figures["files"].items(), key=lambda kv: -kv[1]["wall_s"])
    head = "| file | tests | wall s | compile s | cache hits / misses |"
    lines = [head + (" wall s before |" if before else ""), "|---" * (5 + bool(before)) + "|"]
    for path, r in rows:
        compile_s = r.get("trace_s", 0) + r.get("lower_s", 0) + r.get("compile_s", 0)
        line = (f"| {path} | {r.get('tests', 0)} | {r['wall_s']:.1f} | {compile_s:.1f} | "
                f"{r.get('cache_hits', 0)} / {r.get('cache_misses', 0)} |")  # fmt: skip
        if before:
            line += f" {old[path]['wall_s']:.1f} |" if path in old else " - |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/_timing.py TIMING.json [BEFORE.json]
    import pathlib
    import sys

    runs = [json.loads(pathlib.Path(path).read_text()) for path in sys.argv[1:3]]
    print(markdown(runs[0], runs[1] if len(runs) > 1 else None))
