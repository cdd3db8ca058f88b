"""Helpers: several JAX processes on 127.0.0.1, each a `worker.py` subprocess with 4 CPU devices.

The pytest process's own XLA_FLAGS (8 devices, from tests/conftest.py) and any cluster
variables are not passed on: every subprocess gets exactly the environment a test gives it.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

from _env import compile_cache, xla_flags

ROOT = Path(__file__).parents[2]
WORKER = Path(__file__).parent / "worker.py"
_DROP = ("XLA_FLAGS", "JAX_", "JAXRL_", "SLURM_", "OMPI_", "TPU_", "MEGASCALE_")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without JAX/cluster variables, 4 CPU devices (the session's XLA flags and
    compilation cache: tests/_env.py), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env.update(
        compile_cache(),
        XLA_FLAGS=xla_flags(4),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Procs:
    """Start `worker.py MODE` as process i of n; stop whatever is left at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self, mode: str, process_id: int, num_processes: int, port: int, **env: str):
        out = self.tmp_path / f"process_{process_id}_{port}.log"
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), mode],
            cwd=ROOT,
            env=clean_env(
                JAXRL_COORDINATOR=f"127.0.0.1:{port}",
                JAXRL_NUM_PROCESSES=str(num_processes),
                JAXRL_PROCESS_ID=str(process_id),
                **env,
            ),
            stdout=out.open("w"),
            stderr=subprocess.STDOUT,
        )
        proc.log = out  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def output(proc) -> str:
    return proc.log.read_text()
