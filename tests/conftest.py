"""Test session setup: 8 fake CPU devices (before JAX starts) and the marker tiers.

Markers: `slow` (long, still run in CI), `multiprocess` (several JAX processes on 127.0.0.1),
`gpu` (skipped unless JAX sees a GPU), `entry` (end-to-end `python -m jaxrl.train` runs).
"""

import os
import tempfile

from _env import SESSION_FLAGS, session_flags, xla_flags

# Must happen before anything imports jax: the CPU device count is fixed at backend start.
# The session's flags (tests/_env.py: LLVM level 0, then the caller's) are fixed once, by
# pytest's first process; xdist's workers and the tests' subprocesses inherit them.
if SESSION_FLAGS not in os.environ:
    os.environ[SESSION_FLAGS] = session_flags(os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the session (and the processes its tests start): the many
# runs of the same tiny models compile the same programs, and each is compiled once. Only the
# compile is shared; every test still runs its programs. A fresh folder per session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-test-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest
from hypothesis import HealthCheck, settings

import jaxrl.models as M
from jaxrl.testing.tiny import save_tiny

# Wall and compile time per test file, printed at the end (tests/_timing.py); compiled programs
# dropped between files before the process runs out of memory mappings (tests/_programs.py).
pytest_plugins = ["_timing", "_programs"]

# Property tests (hypothesis) are derandomized: CI sees the same examples each run, so a
# failure reproduces. JAXRL_HYPOTHESIS_EXAMPLES=2000 searches wider by hand.
settings.register_profile(
    "jaxrl",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("JAXRL_HYPOTHESIS_EXAMPLES", "200")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("jaxrl")


# Workers for `-n auto` (pyproject's addopts; `-n 0` runs in one process): one per core this
# process may use, at most one per 6 GiB of memory (the largest tests hold a few GiB) and at
# most 4; PYTEST_XDIST_AUTO_NUM_WORKERS overrides. Whole files go to one worker
# (`--dist loadfile`), so module fixtures are built once.
GIB_PER_WORKER = 6
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # the GPU suite's pytest runs without xdist
def pytest_xdist_auto_num_workers(config):
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, int(memory // GIB_PER_WORKER), MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (JAX sees none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(name) -> (folder, config, params)`: the `jaxrl.testing.tiny` checkpoint
    `name` written with transformers and loaded in float32 once per session (per xdist
    worker), shared by every module that asks for it. The params are shared: a test that
    donates them (an update's state) copies them first."""
    models: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in models:
            folder = save_tiny(name, tmp_path_factory.mktemp(name))
            models[name] = (folder, *M.from_pretrained(folder))
        return models[name]

    return get
