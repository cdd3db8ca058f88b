"""One program over many processes: `jax.distributed` from the environment, and failure handling.

    info = jaxrl.distributed.initialize()   # first thing, before anything touches jax devices
    if jaxrl.distributed.is_main_process():
        ...                                 # files only process 0 writes

Where the processes come from (the first that applies):

1. `JAXRL_COORDINATOR=host:port`, `JAXRL_NUM_PROCESSES=N`, `JAXRL_PROCESS_ID=i`: all three or
   none (`launch/local.sh`, `launch/slurm.sbatch` set them). Every local device is used unless
   JAX's own `JAX_LOCAL_DEVICE_IDS` (or `CUDA_VISIBLE_DEVICES`) narrows them.
2. A cluster JAX detects by itself (`jax._src.clusters`): SLURM tasks started by `srun` (one GPU
   per task, from `SLURM_LOCALID`), Cloud TPU VMs and GKE TPU slices, Open MPI, Kubernetes (with
   `jax[k8s]`). A detected cluster of one process is treated as no cluster.
3. Nothing: a single process; `initialize` does nothing and never touches the devices.

Device-to-device copies between processes (a role on other processes' devices) go over a socket
JAX serves at `JAXRL_TRANSFER_ADDRESS` (host, or host:port; default: this host's address
towards the coordinator, a free port).

Timeouts (seconds, from the arguments or the environment):

- `JAXRL_INIT_TIMEOUT` (default 300): how long a process waits for all peers to join. Past it the
  process prints which processes did not join and the coordinator, and exits with status 1 (the
  join blocks in JAX's C++ client and cannot be interrupted, so this cannot be an exception).
  JAX's own deadline is set 30 s later as a backstop.
- `JAXRL_HEARTBEAT_TIMEOUT` (default 60): a peer silent this long is declared dead. JAX's
  heartbeat (C++ threads, `heartbeat_timeout_seconds`) is set to twice this as a backstop.

What JAX 0.10.2 does on its own when a process dies: the coordination service notices missing
heartbeats after `heartbeat_timeout_seconds` and every survivor aborts (SIGABRT, a fatal log
line listing the unhealthy task ids); when process 0 dies, its in-process service goes with it
and the others abort at once. A peer that never joins makes `initialize` abort the same way,
without naming anyone. On top of that, jaxrl runs a small monitor thread per process (multi-
process runs only) over the coordination service's key-value store:

- every `interval` s each process writes `jaxrl/health/<id> = "alive <tick>"`; a peer whose value
  has not changed for `JAXRL_HEARTBEAT_TIMEOUT` s is dead: print "process j stopped sending
  heartbeats ..." and `os._exit(1)`. When the monitor itself was starved (its own loop late by
  half the timeout), it restarts the clocks instead of blaming the peers.
- an uncaught exception (`sys.excepthook`) marks the process `failed <reason>`; peers print
  "process j failed: <reason>" and exit 1. The failing process waits (at most the heartbeat
  timeout) until its peers have seen that, or until the monitor names a dead peer (a collective
  that errors because a peer died is reported as that peer's death: after a failure a peer
  silent for 3 intervals is named, before JAX's own abort), then exits 1 without JAX's
  shutdown barrier, which would wait for the dead or hung peers.
- a clean exit (`atexit`, before JAX's shutdown) writes `done`; peers stop watching it.
- losing the key-value store means process 0, which hosts the coordination service, is gone.

Each process reads every health key once per interval (N^2 small reads per interval in all):
negligible for tens to hundreds of hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger("jaxrl.distributed")

ENV_COORDINATOR = "JAXRL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"
ENV_INIT_TIMEOUT = "JAXRL_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "JAXRL_HEARTBEAT_TIMEOUT"
ENV_TRANSFER_ADDRESS = "JAXRL_TRANSFER_ADDRESS"
EXPLICIT = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
_JAX_GRACE_S = 30  # JAX's own deadlines sit behind jaxrl's, so jaxrl's message comes first
_HEALTH = "jaxrl/health/"


class DistributedConfigError(ValueError):
    """The JAXRL_* variables (or a timeout) are missing, partial or malformed."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the run (`coordinator` is None for a single process)."""

    process_id: int = 0
    num_processes: int = 1
    coordinator: str | None = None

    @property
    def is_main(self) -> bool:
        return self.process_id == 0


@dataclasses.dataclass(frozen=True)
class _Spec:
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: Sequence[int] | None
    source: str  # "JAXRL_* variables" or the detected cluster


_info: ProcessInfo | None = None
_monitor: _Monitor | None = None


# ----------------------------------------------------------------------------- the environment


def _positive_seconds(name: str, value: float | None, environ: Mapping[str, str]) -> float | None:
    if value is None and name in environ:
        try:
            value = float(environ[name])
        except ValueError:
            raise DistributedConfigError(
                f"{name}={environ[name]!r} is not a number of seconds; set e.g. {name}=300"
            ) from None
    if value is not None and value <= 0:
        raise DistributedConfigError(f"{name}={value}: the timeout must be > 0 seconds")
    return value


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(
            f"{ENV_COORDINATOR}={address!r} is not host:port; set it to the address of process "
            f"0 and a free port, e.g. {ENV_COORDINATOR}=10.0.0.1:8476 (127.0.0.1:PORT on one "
            "machine)"
        )
    return host.strip("[]"), int(port)


def explicit_spec(environ: Mapping[str, str]) -> tuple[str, int, int] | None:
    """`(coordinator, num_processes, process_id)` from the JAXRL_* variables, or None.

    Raises:
        DistributedConfigError: naming the variable and the fix, when some but not all three
            are set, or one is malformed.
    """
    present = [k for k in EXPLICIT if environ.get(k, "").strip()]
    if not present:
        return None
    usage = (
        f"set all three ({ENV_COORDINATOR}=host:port of process 0, {ENV_NUM_PROCESSES}=N, "
        f"{ENV_PROCESS_ID}=0..N-1, different in every process) or none of them (a single "
        "process, or SLURM / TPU auto-detection)"
    )
    missing = [k for k in EXPLICIT if k not in present]
    if missing:
        have = ", ".join(f"{k}={environ[k]}" for k in present)
        raise DistributedConfigError(f"{' and '.join(missing)} not set ({have} are): {usage}")
    coordinator = environ[ENV_COORDINATOR].strip()
    _split_host_port(coordinator)
    raw_n, raw_id = environ[ENV_NUM_PROCESSES].strip(), environ[ENV_PROCESS_ID].strip()
    if not raw_n.isdigit() or int(raw_n) < 1:
        raise DistributedConfigError(
            f"{ENV_NUM_PROCESSES}={raw_n!r} is not a positive integer; set it to the number of "
            "processes in the run (the same in every process)"
        )
    n = int(raw_n)
    if not raw_id.isdigit() or int(raw_id) >= n:
        raise DistributedConfigError(
            f"{ENV_PROCESS_ID}={raw_id!r} is not an integer in [0, {n}) "
            f"({ENV_NUM_PROCESSES}={n}); give each process its own id 0..{n - 1}, 0 on the "
            f"coordinator's host"
        )
    return coordinator, n, int(raw_id)


def _env_local_device_ids(environ: Mapping[str, str]) -> list[int] | None:
    raw = environ.get("JAX_LOCAL_DEVICE_IDS")
    return [int(x) for x in raw.split(",")] if raw else None


def _detect_cluster(timeout_s: float, environ: Mapping[str, str]) -> _Spec | None:
    """What `jax.distributed.initialize()` would auto-detect (SLURM, TPU, MPI, k8s), or None.

    The same steps as `jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params`, done
    here so that the process id and count are known before joining (for the messages).
    """
    from jax._src import clusters
    from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm

    env = next(
        (
            c
            for c in clusters.ClusterEnv._cluster_types
            if not c.opt_in_only_method and c.is_env_present()
        ),
        None,
    )
    if env is None:
        return None
    coordinator = environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
        timeout_secs=int(timeout_s), override_coordinator_port=environ.get("JAX_COORDINATOR_PORT")
    )
    local_ids = _env_local_device_ids(environ)
    if local_ids is None and not running_in_cloud_tpu_vm:  # JAX: one device per local task
        local_id = env.get_local_process_id()
        local_ids = None if local_id is None else [local_id]
    return _Spec(
        coordinator,
        env.get_process_count(),
        env.get_process_id(),
        local_ids,
        f"{env.name or env.__name__} auto-detection",
    )


def _resolve(environ: Mapping[str, str], timeout_s: float) -> _Spec | None:
    explicit = explicit_spec(environ)
    if explicit is not None:
        coordinator, n, pid = explicit
        return _Spec(coordinator, n, pid, _env_local_device_ids(environ), "JAXRL_* variables")
    spec = _detect_cluster(timeout_s, environ)
    if spec is None or spec.num_processes == 1:
        return None
    return spec


# ---------------------------------------------------------------------------------- initialize


def initialize(
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessInfo:
    """Join the run's other processes (`jax.distributed.initialize`), or do nothing alone.

    Call before anything touches JAX devices. Idempotent: later calls return the first result.

    Args:
        timeout_s: Longest wait for every process to join; default `JAXRL_INIT_TIMEOUT` or 300.
        heartbeat_timeout_s: Silence after which a peer is dead; default
            `JAXRL_HEARTBEAT_TIMEOUT` or 60.
        environ: Where to read the JAXRL_* and timeout variables (default `os.environ`);
            JAX's cluster detection always reads `os.environ`.

    Returns:
        This process's id, the process count and the coordinator (None when alone).

    Raises:
        DistributedConfigError: the JAXRL_* variables are partial or malformed.
    """
    global _info, _monitor
    if _info is not None:
        return _info
    environ = os.environ if environ is None else environ
    timeout_s = _positive_seconds(ENV_INIT_TIMEOUT, timeout_s, environ) or DEFAULT_INIT_TIMEOUT_S
    heartbeat_timeout_s = (
        _positive_seconds(ENV_HEARTBEAT_TIMEOUT, heartbeat_timeout_s, environ)
        or DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    import jax

    if jax.distributed.is_initialized():  # someone called jax.distributed.initialize already
        from jax._src.distributed import global_state as gs

        _info = ProcessInfo(gs.process_id, gs.num_processes, gs.coordinator_address)
        return _info
    spec = _resolve(environ, timeout_s)
    if spec is None:
        _info = ProcessInfo()
        return _info
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in environ:
        # Cross-process collectives on CPU devices (the default in 0.10.2; explicit here).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec.num_processes > 1:
        _enable_transfers(spec, environ)
    prefix = _prefix(spec.process_id, spec.num_processes)
    _say(
        f"{prefix}joining {spec.num_processes} processes at coordinator {spec.coordinator} "
        f"({spec.source}; timeout {timeout_s:g} s)"
    )
    start = time.monotonic()
    timer = threading.Timer(timeout_s, _join_timed_out, args=(spec, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=spec.local_device_ids,
            cluster_detection_method="deactivate",  # resolved above; don't let JAX redo it
            initialization_timeout=int(timeout_s) + _JAX_GRACE_S,
            heartbeat_timeout_seconds=int(2 * heartbeat_timeout_s),
        )
    finally:
        timer.cancel()
    _say(f"{prefix}joined in {time.monotonic() - start:.1f} s")
    _info = ProcessInfo(spec.process_id, spec.num_processes, spec.coordinator)
    if spec.num_processes > 1:
        _monitor = _Monitor(_info, heartbeat_timeout_s)
        _monitor.start()
    return _info


def _enable_transfers(spec: _Spec, environ: Mapping[str, str]) -> None:
    """Device-to-device copies between processes (`jax.device_put` from one process's devices
    to another's: a role on other processes' devices, `jaxrl.sharding.reshard.moved`): JAX
    serves them from a socket at `JAXRL_TRANSFER_ADDRESS` (host, or host:port), default this
    host's address towards the coordinator and a free port. A JAX without the option (its
    own transport) is left as it is."""
    address = environ.get(ENV_TRANSFER_ADDRESS) or _facing(spec.coordinator)
    if ":" not in address.rsplit("]", 1)[-1]:
        address = f"{address}:{_free_port(address)}"
    import jax

    try:
        jax.config.update("jax_cross_host_transfer_socket_address", address)
    except AttributeError:
        log.info("this JAX has no jax_cross_host_transfer_socket_address; not set")


def _facing(coordinator: str) -> str:
    """This host's address on the route to the coordinator (127.0.0.1 for a local one)."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _join_timed_out(spec: _Spec, timeout_s: float) -> None:
    """Runs in a timer thread while the main thread is stuck in JAX's join."""
    pid, n = spec.process_id, spec.num_processes
    others = [i for i in range(n) if i != pid]
    rest = [i for i in others if i]  # for a process other than 0: the others except 0
    reachable = None if pid == 0 else _reachable(spec.coordinator)
    if pid == 0:
        # The service keeps who registered to itself until everyone has: with one peer it is
        # that peer; with more, one or more of them.
        missing = f"{others}" if len(others) == 1 else f"one or more of {others}"
    elif reachable is False:
        missing = f"[0] (nothing listens at {spec.coordinator})"
        missing += f", maybe also some of {rest}" if rest else ""
    elif reachable is None:
        missing = f"one or more of {others}"
    elif rest:
        missing = f"one or more of {rest} (the coordinator is up)"
    else:
        missing = (
            "none seen missing: process 0 listens, but registration did not complete "
            "(another job on that port, or a different process count there?)"
        )
    hint = (
        f"Start every process with the same {ENV_COORDINATOR} and {ENV_NUM_PROCESSES}={n}, "
        f"and {ENV_PROCESS_ID} 0..{n - 1} once each; raise {ENV_INIT_TIMEOUT} if processes "
        "start slowly"
        if spec.source == "JAXRL_* variables"
        else f"Processes come from {spec.source}; check that every task started"
    )
    _say(
        f"{_prefix(pid, n)}error: process {pid} of {n} waited {timeout_s:g} s at coordinator "
        f"{spec.coordinator}; processes that did not join: {missing}. {hint}"
    )
    _exit(1)


def _reachable(address: str) -> bool | None:
    """Whether something accepts TCP connections at host:port (None: cannot tell)."""
    try:
        host, port = _split_host_port(address)
    except DistributedConfigError:
        return None
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------- failures


class _Monitor(threading.Thread):
    """Heartbeats through the coordination service's key-value store (see the module doc)."""

    def __init__(self, info: ProcessInfo, timeout_s: float):
        super().__init__(name="jaxrl-health", daemon=True)
        from jax._src.distributed import global_state

        self.client = global_state.client
        self.info = info
        self.timeout_s = timeout_s
        self.interval_s = min(max(timeout_s / 10, 0.2), 5.0)
        self.peers = [i for i in range(info.num_processes) if i != info.process_id]
        self.prefix = _prefix(info.process_id, info.num_processes)
        self.failed: str | None = None
        self.exit_code = 1
        self._final = False  # "done" or "failed" written: no more "alive"
        self._lock = threading.Lock()
        self._hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.finish)  # atexit is LIFO: runs before JAX's shutdown barrier

    def _key(self, i: int) -> str:
        return f"{_HEALTH}{i}"

    def _write(self, value: str, final: bool = False) -> None:
        with self._lock:
            if self._final:
                return
            self._final = final
            self.client.key_value_set(self._key(self.info.process_id), value, allow_overwrite=True)

    def run(self) -> None:
        start = last_loop = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {j: (None, start) for j in self.peers}
        tick = 0
        while True:
            time.sleep(self.interval_s)
            if self._final and self.failed is None:
                return  # a clean exit is under way (JAX's shutdown barrier takes over)
            now = time.monotonic()
            if now - last_loop > self.timeout_s / 2:  # this thread was starved: blame no one
                seen = {j: (v, now) for j, (v, _) in seen.items()}
            last_loop = now
            tick += 1
            try:
                self._write(f"alive {tick}")
                entries = dict(self.client.key_value_dir_get(_HEALTH))
            except Exception as e:
                if self._final and self.failed is None:
                    return
                self._die(
                    f"lost the coordination service at {self.info.coordinator} "
                    f"({_first_line(e)}): process 0, which hosts it, died or is unreachable"
                )
                return
            # Once this process has failed (often a collective that errored because a peer
            # died), a peer silent for a few intervals is named: JAX's own abort must not
            # come first.
            silence = self.timeout_s if self.failed is None else 3 * self.interval_s
            ended = 0
            for j in self.peers:
                value = entries.get(self._key(j))
                if value == "done":
                    ended += 1
                elif value is not None and value.startswith("failed"):
                    ended += 1
                    if self.failed is None:
                        self._die(f"process {j} failed: {value[len('failed') :].strip()}")
                elif value != seen[j][0]:
                    seen[j] = (value, now)
                elif now - seen[j][1] > silence:
                    self._die(
                        f"process {j} stopped sending heartbeats {silence:g} s ago: it "
                        "died, was killed or hangs (see its log)"
                    )
            if self.failed is not None and ended == len(self.peers):
                _exit(self.exit_code)  # every peer has seen this process fail, or had ended

    def fail(self, reason: str, exit_code: int = 1) -> None:
        """Tell the peers this process failed; they exit naming it."""
        if self.failed is None:
            self.failed, self.exit_code = reason, exit_code
            with contextlib.suppress(Exception):
                self._write(f"failed {reason}", final=True)

    def _die(self, reason: str) -> None:
        self.fail(reason)
        _say(f"{self.prefix}error: {reason}; exiting")
        if self.info.process_id == 0:
            # Keep the coordination service up a moment, so that the others read this verdict
            # and leave with it rather than with JAX's abort on losing the service.
            time.sleep(2 * self.interval_s)
        _exit(1)

    def _excepthook(self, kind, value, tb) -> None:
        self._hook(kind, value, tb)
        self.fail(f"{kind.__name__}: {_first_line(value)}")
        # The monitor exits once the peers have seen this, or names a peer that died (often the
        # cause of an error in a collective); after one heartbeat timeout, exit anyway.
        time.sleep(self.timeout_s + 2 * self.interval_s)
        _exit(1)

    def finish(self) -> None:
        """At a clean exit: tell the peers not to wait for this process."""
        with contextlib.suppress(Exception):
            self._write("done", final=True)


def mark_failed(reason: str, exit_code: int = 1) -> None:
    """Tell the other processes this one failed (they exit naming it); no-op when alone.

    Uncaught exceptions do this by themselves; call it before a deliberate non-zero exit. Once
    every peer has seen it (or ended), this process exits with `exit_code` (JAX's shutdown
    barrier would otherwise wait for peers that are leaving).
    """
    if _monitor is not None:
        _monitor.fail(reason, exit_code)


# ------------------------------------------------------------------------------------- helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _prefix(process_id: int, num_processes: int) -> str:
    return f"[process {process_id}/{num_processes}] " if num_processes > 1 else ""


def process_info() -> ProcessInfo:
    """This process's place in the run, without touching the devices."""
    if _info is not None:
        return _info
    from jax._src.distributed import global_state as gs

    if gs.client is not None:
        return ProcessInfo(gs.process_id, gs.num_processes, gs.coordinator_address)
    return ProcessInfo()


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Wait until every process reaches `barrier(name)` (the coordination service's barrier,
    no devices involved); no-op alone. Use each name once per run."""
    info = process_info()
    if info.num_processes == 1:
        return
    from jax._src.distributed import global_state

    global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


_PART_BYTES = 1 << 20  # a message's parts: far below the store's gRPC message limits


def post(key: str, data: bytes) -> None:
    """Store `data` under `key` in the coordination service's key-value store (a message to
    the other processes, no devices involved: `wait_for` reads it), in parts of at most 1 MiB
    (`key/0`, `key/1`, ...; `key` itself, written last, holds their count). Several
    processes only."""
    from jax._src.distributed import global_state

    client = global_state.client
    parts = [data[i : i + _PART_BYTES] for i in range(0, len(data), _PART_BYTES)] or [b""]
    for i, part in enumerate(parts):
        client.key_value_set_bytes(f"{key}/{i}", part, allow_overwrite=True)
    client.key_value_set(key, str(len(parts)), allow_overwrite=True)


def wait_for(key: str, timeout_s: float) -> bytes | None:
    """The bytes `post`ed under `key`, waiting at most `timeout_s` seconds for them; None if
    they did not come. Several processes only."""
    from jax._src.distributed import global_state

    client = global_state.client
    try:
        count = int(client.blocking_key_value_get(key, int(timeout_s * 1000)))
    except Exception as e:  # a JaxRuntimeError "DEADLINE_EXCEEDED: GetKeyValue() timed out"
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise
    return b"".join(client.key_value_try_get_bytes(f"{key}/{i}") for i in range(count))


def forget(key: str) -> None:
    """Delete a `post`ed message (once every reader has it); nothing if there is none."""
    from jax._src.distributed import global_state

    client = global_state.client
    try:
        count = int(client.key_value_try_get(key))
    except Exception:  # not there (a resumed run's first steps): nothing to delete
        return
    client.key_value_delete(key)
    for i in range(count):
        client.key_value_delete(f"{key}/{i}")


class StepMessages:
    """A message per training step from one process to others (`post` / `wait_for` under
    `prefix`), each receiver's own (`to`: its process id) or shared (`to=None`). Sending step
    k's deletes step k - 2's: every process has read it, having taken part in a collective of
    step k - 1 after reading it."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def _key(self, step: int, to: int | None) -> str:
        return f"{self.prefix}{step}" if to is None else f"{self.prefix}{step}/{to}"

    def send(self, step: int, data: bytes, to: int | None = None) -> None:
        post(self._key(step, to), data)
        if step > 2:
            forget(self._key(step - 2, to))

    def receive(self, step: int, timeout_s: float, to: int | None = None) -> bytes | None:
        """Step `step`'s message, or None after `timeout_s` seconds without it."""
        return wait_for(self._key(step, to), timeout_s)


def is_main_process() -> bool:
    """True on process 0 (and in single-process runs): the one that writes the run's files."""
    return process_info().is_main


def process_log_prefix() -> str:
    """`"[process i/N] "` in multi-process runs, `""` alone."""
    info = process_info()
    return _prefix(info.process_id, info.num_processes)


def start_command() -> int | None:
    """What a command line (`jaxrl.train`, `jaxrl.sft`, `jaxrl.dpo`) does first: join the
    other processes (before anything touches the devices), then set up logging with this
    process's prefix. Returns an exit code (2) after printing the error if joining fails,
    else None."""
    try:
        initialize()
    except DistributedConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.WARNING,
        format=process_log_prefix() + "%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("jaxrl").setLevel(logging.INFO)
    return None
