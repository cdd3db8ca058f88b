"""A sandboxed Python subprocess for tools that run model-written code (`run_python`).

    result = run_python("print(2 + 3)", timeout_s=10, cpu_s=10, memory_mb=1024,
                        max_output_bytes=4096)
    result.stdout           # "5\\n"
    result.killed_reason    # None, or why it stopped: "timeout", "cpu_time", "memory", ...
    isolation()             # what this machine enforces: {"network_namespace": True, ...}

Every call runs the code in a fresh interpreter (`sys.executable -I -B`) in a directory of its
own (its cwd, HOME and TMPDIR, removed afterwards), with an explicit minimal environment and
stdin closed. Three processes carry the layers, each applied where the kernel allows it and
reported in `SandboxResult.isolation` (`isolation()` probes them once and caches):

    this process   reads stdout/stderr (a capped head and tail) and the status pipe; backstop
    └─ boot        python -I sandbox.py --boot: new session; unshare(user|net|pid|ipc);
       │           kills the init's process group at the wall-clock limit
       └─ init     fork: pid 1 of the new PID namespace, its own process group; caps the
          │        namespace's pid_max; reaps orphans; reports the runner's exit status
          └─ runner  fork + exec python -I -B sandbox.py --run: rlimits and Landlock before
                     the exec, the audit hook after it, then the code (as `__main__`)

- Namespaces: a new user namespace (unprivileged) owning new network (no interface but a
  down loopback), PID (the code sees only its own processes, and when the init exits the
  kernel kills every process left, even those that left the process group) and IPC ones.
- Limits (`setrlimit`, inherited by every process the code starts): address space, CPU
  seconds (SIGXCPU, then SIGKILL a second later), file size, no core files, and processes:
  RLIMIT_NPROC in the user namespace (the kernel does not enforce it for root) and the PID
  namespace's own pid_max (Linux >= 6.14, at least 301 pids).
- Landlock (Linux >= 5.13, unprivileged): read-only access to the Python installation, the
  system libraries and a few /etc files, read-write access to the work directory only; TCP
  bind/connect denied (ABI >= 4); signals and abstract unix sockets scoped (ABI >= 6).
- A Python audit hook: the same file policy at the Python level and no non-unix sockets. A
  second layer, and the only file restriction where the kernel has no Landlock; not a
  security boundary by itself (ctypes, C extensions and child interpreters bypass it).

The status pipe carries JSON lines from boot, init and the runner before its exec (never the
code's), so the outcome comes from outside the code's reach. `docs/sandbox.md` says what is
and is not isolated, and on which machines.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import dataclasses
import errno
import functools
import json
import linecache
import math
import os
import re
import resource
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import Any

CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every arch.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS = 38

# What the code may read besides its own directory (when they exist): the system's
# libraries and binaries, and the /etc files that the C library and Python's stdlib read.
# Not /etc as a whole (shadow, keys), /home, /root, /tmp, /proc, /sys, /var, /dev/shm.
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
ETC_READ_PATHS = tuple(
    f"/etc/{name}"
    for name in (
        "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd",
        "group", "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf",
        "mime.types", "ssl", "ca-certificates", "os-release",
    )
)  # fmt: skip
DEVICE_READ_PATHS = ("/dev/zero", "/dev/urandom", "/dev/random")
DEVICE_WRITE_PATHS = ("/dev/null",)

LAYERS = (
    "user_namespace", "network_namespace", "pid_namespace", "ipc_namespace",
    "pid_limit", "process_limit", "landlock_fs", "landlock_net", "landlock_scope",
    "audit_hook",
)  # fmt: skip
GRACE_S = 3.0  # after the wall-clock limit: then this process kills the init, then the boot
NICE = 10  # the code runs niced: the boot, the init and the trainer get the CPU first
PID_MAX_MIN = 301  # the kernel's floor for a namespace's pid_max (RESERVED_PIDS + 1)
_EXCEPTION_REASONS = {
    "MemoryError": "memory",
    "BlockingIOError": "processes",  # fork/clone: EAGAIN at the process limit
    "PermissionError": "permission",
}
_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")


@dataclasses.dataclass
class SandboxResult:
    """What a sandboxed run printed and how it ended.

    Attributes:
        stdout, stderr: The program's output, decoded (UTF-8, invalid bytes replaced); past
            `max_output_bytes` only its head and tail, with a `[... N bytes truncated ...]`
            line between them.
        exit_code: The runner's exit status; None when a signal ended it or it was killed.
        signal: The signal that ended the runner (e.g. SIGXCPU at the CPU limit), or None.
        timed_out: The wall-clock limit was reached and everything was killed.
        killed_reason: Why it stopped, when a limit or the sandbox stopped it: "timeout",
            "cpu_time", "memory" (a MemoryError at the address-space limit), "processes" (a
            fork failed at the process limit), "permission" (an uncaught PermissionError:
            the sandbox denied an access), "signal"; None for a normal exit.
        truncated: stdout or stderr was longer than `max_output_bytes`.
        wall_s: Seconds from start to the last process reaped.
        cpu_s: CPU seconds of the runner (and the children it reaped), when known.
        exception: The uncaught exception's type name (from the traceback), if any.
        isolation: The layers this run applied (keys: `LAYERS`).
        error: The sandbox's own failure (not the program's), e.g. the runner did not start.
        pid: The boot process's pid: the session id of every process the run started.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    killed_reason: str | None
    truncated: bool
    wall_s: float
    cpu_s: float | None = None
    exception: str | None = None
    isolation: dict[str, bool] = dataclasses.field(default_factory=dict)
    error: str | None = None
    pid: int = 0


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    cpu_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 4096,
    max_processes: int = 64,
    file_size_mb: int = 64,
    env: Mapping[str, str] | None = None,
    extra_read_paths: Sequence[str] = (),
    namespaces: bool = True,
    landlock: bool = True,
    audit_hook: bool = True,
    tmp_dir: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox; blocks until it ends or is killed.

    Args:
        code: The program's source.
        timeout_s: Wall-clock limit; then its process group is killed (and its PID
            namespace with it).
        cpu_s: CPU limit per process (RLIMIT_CPU, whole seconds, rounded up).
        memory_mb: Address-space limit per process (RLIMIT_AS).
        max_output_bytes: Kept per stream (head and tail); the rest is read and dropped.
        max_processes: RLIMIT_NPROC inside the user namespace (not enforced for root).
        file_size_mb: Largest file the program may write (RLIMIT_FSIZE).
        env: Variables added to the minimal environment.
        extra_read_paths: More paths the program may read (Landlock and the audit hook).
        namespaces, landlock, audit_hook: False turns that layer off (tests, debugging).
        tmp_dir: Where the run's temporary directory goes (default: the system's).
    """
    root = tempfile.mkdtemp(prefix="jaxrl_sandbox_", dir=tmp_dir)
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        code_path = os.path.join(root, "code.py")
        with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        config = {
            "work": work,
            "code_path": code_path,
            "script": os.path.abspath(__file__),
            "timeout_s": float(timeout_s),
            "cpu_s": float(cpu_s),
            "memory_mb": int(memory_mb),
            "file_size_mb": int(file_size_mb),
            "max_processes": int(max_processes),
            "read_paths": [*default_read_paths(), *extra_read_paths],
            "namespaces": namespaces,
            "landlock": landlock,
            "audit_hook": audit_hook,
            "is_root": os.getuid() == 0,
        }
        return _spawn(config, _environment(work, env), max_output_bytes)
    finally:
        _remove_tree(root)


def isolation() -> dict[str, bool]:
    """Which layers this machine applies (keys: `LAYERS`), probed once by running `pass`.

    A layer is False where the kernel refused it (e.g. no unprivileged user namespaces, no
    Landlock): the sandbox then runs without it. `docs/sandbox.md` says what each one means.
    """
    return dict(_probe())


@functools.cache
def _probe() -> dict[str, bool]:
    try:
        result = run_python("pass", timeout_s=30, cpu_s=10, memory_mb=1024)
    except OSError:
        return dict.fromkeys(LAYERS, False)
    return result.isolation


def default_read_paths() -> list[str]:
    """What the program may read: this interpreter's installation and the system's files."""
    paths = {
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
        *(sysconfig.get_paths().values()),
        *SYSTEM_READ_PATHS,
        *ETC_READ_PATHS,
        *DEVICE_READ_PATHS,
    }
    # "/" would open everything (an interpreter installed at the root is not supported).
    return sorted(p for p in paths if os.path.abspath(p) != "/" and os.path.exists(p))


# --------------------------------------------------------------------- this process's side


def _environment(work: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    """The program's whole environment: nothing inherited but what is named here."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        # One BLAS/OpenMP thread: a thread pool per process would eat the memory limit.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def _spawn(config: dict[str, Any], env: dict[str, str], max_output_bytes: int) -> SandboxResult:
    """Start the boot process, collect its output and status, and leave nothing running."""
    status_r, status_w = os.pipe()
    config["status_fd"] = status_w
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", config["script"], "--boot", json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=config["work"],
            env=env,
            start_new_session=True,
            pass_fds=(status_w,),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        deadline = start + config["timeout_s"] + GRACE_S
        out, err, status, backstop = _collect(proc, status_r, max_output_bytes, deadline)
    finally:
        _kill_sandbox(proc.pid, None)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        os.close(status_r)
    return _result(proc, config, out, err, status, backstop, time.monotonic() - start)


class _Capture:
    """The head and tail of a stream, `limit` bytes in all; counts the bytes dropped."""

    def __init__(self, limit: int):
        self.head_cap = max(0, limit) // 2
        self.tail_cap = max(0, limit) - self.head_cap
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        take = min(len(data), self.head_cap - len(self.head))
        self.head += data[:take]
        self.tail += data[take:]
        if len(self.tail) > 2 * self.tail_cap + 65536:  # trim now and then, not every read
            del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> tuple[str, bool]:
        """The kept text, marked where bytes were dropped, and whether any were."""
        tail = self.tail[len(self.tail) - self.tail_cap :] if self.tail_cap else b""
        dropped = self.total - len(self.head) - len(tail)
        head = self.head.decode("utf-8", errors="replace")
        if dropped <= 0:
            return (self.head + tail).decode("utf-8", errors="replace"), False
        marker = f"\n[... {dropped} bytes truncated ...]\n"
        return head + marker + bytes(tail).decode("utf-8", errors="replace"), True


def _collect(
    proc: subprocess.Popen, status_fd: int, limit: int, deadline: float
) -> tuple[_Capture, _Capture, dict[str, Any], bool]:
    """Read stdout, stderr and the status pipe until every writer is gone.

    The boot process enforces the wall-clock limit. Past `deadline` (that limit plus a grace)
    this process kills the init's group itself (the backstop: the boot then reaps the init
    and reports); a grace later, the boot's group too. Once the boot has exited, whatever is
    left of its groups is killed and the pipes get a short grace.

    Returns:
        (stdout, stderr, the parsed status, whether the backstop fired).
    """
    out, err, raw = _Capture(limit), _Capture(limit), bytearray()
    sinks = {proc.stdout.fileno(): out.add, proc.stderr.fileno(): err.add, status_fd: raw.extend}
    backstop, swept = 0, False
    with selectors.DefaultSelector() as selector:
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                if backstop == 2 or swept:
                    break  # a process outside its groups holds a pipe: stop waiting for it
                backstop += 1
                group = _parse_status(raw).get("group")
                last = backstop == 2 or group is None
                _kill_sandbox(proc.pid, group, boot=last, scan=last)
                deadline = now + GRACE_S
            for key, _ in selector.select(timeout=min(deadline - now, 0.1)):
                data = os.read(key.fd, 65536)
                if data:
                    sinks[key.fd](data)
                else:
                    selector.unregister(key.fd)
            if not swept and _exited(proc.pid):
                swept = True
                _kill_sandbox(proc.pid, _parse_status(raw).get("group"))
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return out, err, _parse_status(raw), backstop > 0


def _exited(pid: int) -> bool:
    """Whether child `pid` has exited, leaving it unreaped (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_sandbox(boot_pid: int, group: Any, *, boot: bool = True, scan: bool = False) -> None:
    """SIGKILL the init's process `group`, and (if `boot`) the boot's (if `scan`, its session).

    `group` comes from the status pipe: it is killed only if it is a process group of the
    boot's session, so nothing written there can aim this at another process.
    """
    if isinstance(group, int) and group > 1 and _session(group) == boot_pid:
        _killpg(group)
    if boot:
        _killpg(boot_pid)
    if boot and scan:
        _kill_session(boot_pid)


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`, found in /proc (when the init's group is not
    known, e.g. the boot was killed before it reported it). A pidfd pins each process
    between the check and the signal, so a reused pid is never signalled."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            pidfd = os.pidfd_open(int(entry))
        except (AttributeError, OSError):
            continue
        try:
            if _session(int(entry)) == sid:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _session(pid: int) -> int | None:
    """The session id of process `pid` (from /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[3])  # state, ppid, pgrp, session


def _parse_status(raw: bytes | bytearray) -> dict[str, Any]:
    """The status pipe's JSON lines merged into one dict (a later line wins)."""
    status: dict[str, Any] = {}
    for line in bytes(raw).splitlines():
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            if isinstance(fields, dict):
                status.update(fields)
    return status


def _result(
    proc: subprocess.Popen,
    config: dict[str, Any],
    out: _Capture,
    err: _Capture,
    status: dict[str, Any],
    backstop: bool,
    wall_s: float,
) -> SandboxResult:
    """Assemble the `SandboxResult` from the status lines and the captured streams."""
    stdout, out_cut = out.text()
    stderr, err_cut = err.text()
    timed_out = bool(status.get("timed_out")) or backstop
    exit_code, sig = status.get("exit_code"), status.get("signal")
    error = status.get("error")
    if exit_code is None and sig is None and not timed_out and error is None:
        error = f"the sandbox's boot process ended without a result (status {proc.returncode})"
    exception = _exception(stderr) if exit_code == 1 else None
    cpu_s = status.get("cpu_s")
    reason = _reason(timed_out, sig, exception, cpu_s, config["cpu_s"])
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        signal=sig,
        timed_out=timed_out,
        killed_reason=reason,
        truncated=out_cut or err_cut,
        wall_s=wall_s,
        cpu_s=cpu_s,
        exception=exception,
        isolation={
            **{layer: bool(status.get(layer)) for layer in LAYERS},
            # The runner installs it before the code (it cannot report on the status pipe).
            "audit_hook": bool(config["audit_hook"]) and error is None,
        },
        error=error,
        pid=proc.pid,
    )


def _exception(stderr: str) -> str | None:
    """The uncaught exception's type: the last line of the traceback, when it names one."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    match = _EXCEPTION_LINE.match(lines[-1]) if lines else None
    return match.group(1).rpartition(".")[2] if match else None


def _reason(
    timed_out: bool, sig: int | None, exception: str | None, cpu_s: float | None, cpu_limit: float
) -> str | None:
    """Why the run stopped, when a limit or the sandbox stopped it (see `SandboxResult`)."""
    if timed_out:
        return "timeout"
    if sig == signal.SIGXCPU or (
        sig == signal.SIGKILL and cpu_s is not None and cpu_s >= math.ceil(cpu_limit)
    ):
        return "cpu_time"
    if sig is not None:
        return "signal"
    return _EXCEPTION_REASONS.get(exception or "")


def _remove_tree(path: str) -> None:
    """Remove the run's directory, making unreadable or read-only parts writable first."""

    def retry(function, failed: str, _exc_info) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    shutil.rmtree(path, onerror=retry)


# ------------------------------------------------------------------ the sandbox's processes


def _report(fd: int, **fields: Any) -> None:
    """One JSON line on the status pipe (a write below PIPE_BUF is atomic)."""
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(fields) + "\n").encode())


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _boot(config: dict[str, Any]) -> int:
    """The boot process: enter the namespaces, start the init, enforce the wall clock."""
    fd = config["status_fd"]
    layers = _unshare(config["namespaces"])
    _report(fd, **layers)
    init = os.fork()
    if init == 0:
        code = 70
        try:
            code = _init(config, layers)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    with contextlib.suppress(OSError):
        os.setpgid(init, init)  # the init does it too; whichever runs first
    _report(fd, group=init)
    timed_out = not _wait_exit(init, config["timeout_s"])
    if timed_out:
        _killpg(init)
        with contextlib.suppress(ProcessLookupError):
            os.kill(init, signal.SIGKILL)
    os.waitid(os.P_PID, init, os.WEXITED | os.WNOWAIT)
    _killpg(init)  # what is left of its group (without a PID namespace); its pgid is reserved
    os.waitpid(init, 0)
    _report(fd, timed_out=timed_out)
    return 0


def _unshare(enabled: bool) -> dict[str, bool]:
    """Enter new namespaces, the most that works: user+net+pid+ipc first.

    Without unprivileged user namespaces, root still gets net+pid+ipc (keeping its
    capabilities: see docs/sandbox.md); then a bare network namespace; then none.
    """
    names = {
        CLONE_NEWUSER: "user_namespace",
        CLONE_NEWNET: "network_namespace",
        CLONE_NEWPID: "pid_namespace",
        CLONE_NEWIPC: "ipc_namespace",
    }
    layers = dict.fromkeys(names.values(), False)
    every = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
    for flags in (every, every & ~CLONE_NEWUSER, CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET):
        if enabled and _libc().unshare(flags) == 0:
            layers.update({name: bool(flags & flag) for flag, name in names.items()})
            break
    return layers


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for child `pid` to exit (leaving it unreaped); True if it did."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _exited(pid)
            if pidfd is not None:
                if select.select([pidfd], [], [], remaining)[0]:
                    return True
            elif _exited(pid):
                return True
            else:
                time.sleep(min(0.02, remaining))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _init(config: dict[str, Any], layers: dict[str, bool]) -> int:
    """The init (pid 1 of the PID namespace when there is one): start the runner, reap.

    When it returns, the kernel kills every process left in its PID namespace.
    """
    os.setpgid(0, 0)
    fd = config["status_fd"]
    if layers["pid_namespace"] and layers["user_namespace"]:
        _report(fd, pid_limit=_set_pid_max(max(PID_MAX_MIN, config["max_processes"] + 2)))
    runner = os.fork()
    if runner == 0:
        try:
            _exec_runner(config, layers)
        except BaseException as exc:
            _report(fd, error=f"could not start the runner: {exc!r}")
        finally:
            os._exit(127)
    while True:
        pid, status, usage = os.wait4(-1, 0)  # pid 1 also reaps the orphans
        if pid == runner:
            exit_fields = (
                {"signal": os.WTERMSIG(status)}
                if os.WIFSIGNALED(status)
                else {"exit_code": os.waitstatus_to_exitcode(status)}
            )
            _report(fd, cpu_s=usage.ru_utime + usage.ru_stime, **exit_fields)
            return 0


def _set_pid_max(pid_max: int) -> bool:
    """Cap the PID namespace's pids (Linux >= 6.14 keeps pid_max per namespace).

    Only called inside a new user namespace: on an older kernel the sysctl is the host's and
    the write fails there (no capability over the initial namespace), never changing it.
    """
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if not release or tuple(map(int, release.groups())) < (6, 14):
        return False
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(pid_max))
    except OSError:
        return False
    return True


def _exec_runner(config: dict[str, Any], layers: dict[str, bool]) -> None:
    """The runner before its exec: rlimits and Landlock (inherited by all it starts), exec."""
    fd = config["status_fd"]
    # RLIMIT_NPROC counts the (user namespace, uid) pair's tasks: boot and init included.
    nproc = config["max_processes"] + 2 if layers["user_namespace"] else None
    _set_limits(config, nproc)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    applied = {"landlock_fs": False, "landlock_net": False, "landlock_scope": False}
    if config["landlock"]:
        applied = _landlock(_landlock_rules(config))
    _report(fd, process_limit=nproc is not None and not config["is_root"], **applied)
    os.set_inheritable(fd, False)  # the code never holds the status pipe
    script = config["script"]
    runner_config = {k: config[k] for k in ("work", "code_path", "read_paths", "audit_hook")}
    argv = [sys.executable, "-I", "-B", script, "--run", json.dumps(runner_config)]
    os.execv(sys.executable, argv)


def _set_limits(config: dict[str, Any], nproc: int | None) -> None:
    """The rlimits: address space, CPU seconds (SIGXCPU, SIGKILL 1 s later), file size."""
    cpu = max(1, math.ceil(config["cpu_s"]))
    _limit(resource.RLIMIT_AS, config["memory_mb"] * 2**20)
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_FSIZE, config["file_size_mb"] * 2**20)
    _limit(resource.RLIMIT_CORE, 0)
    if nproc is not None:
        _limit(resource.RLIMIT_NPROC, nproc)


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit to `soft`/`hard` (never above the current hard limit)."""
    _, current = resource.getrlimit(kind)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


def _landlock_rules(config: dict[str, Any]) -> list[tuple[str, int]]:
    """(path, access) pairs: read the installation, write the work directory, run itself."""
    rules = [(path, FS_READ) for path in config["read_paths"]]
    rules += [(path, FS_READ_FILE) for path in (config["script"], config["code_path"])]
    device = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
    rules += [(path, device) for path in DEVICE_WRITE_PATHS]
    rules.append((config["work"], -1))  # every right Landlock handles
    return rules


def _syscall(number: int, *args: Any) -> int:
    result = _libc().syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (old kernel, or not enabled)."""
    try:
        return _syscall(
            SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
        )  # fmt: skip
    except OSError:
        return 0


def _landlock(rules: Sequence[tuple[str, int]]) -> dict[str, bool]:
    """Restrict this process and all it will start to `rules` (Landlock; unprivileged).

    Every filesystem right the kernel's ABI knows is handled (so denied unless a rule grants
    it under a path); TCP bind/connect are handled with no rule (ABI >= 4: denied); signals
    and abstract unix sockets are scoped to the sandbox (ABI >= 6). Needs no_new_privs.
    """
    abi = _landlock_abi()
    if abi < 1:
        return {"landlock_fs": False, "landlock_net": False, "landlock_scope": False}
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    fs |= (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    fs |= FS_IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as this ABI knows it
    ruleset = _syscall(
        SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    try:
        for path, access in rules:
            _landlock_allow(ruleset, path, fs & access)
        if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return {"landlock_fs": True, "landlock_net": bool(net), "landlock_scope": bool(scoped)}


def _landlock_allow(ruleset: int, path: str, access: int) -> None:
    """Grant `access` beneath `path` (only file rights on a file); skip a missing path."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= FS_FILE_RIGHTS
        rule = _PathBeneathAttr(access, fd)
        _syscall(
            SYS_LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
            ctypes.byref(rule), ctypes.c_uint32(0),
        )  # fmt: skip
    finally:
        os.close(fd)


def _run(config: dict[str, Any]) -> int:
    """The runner after its exec: the audit hook, then the code as `__main__`.

    An uncaught exception prints its traceback without this function's frame and exits 1,
    as `python file.py` would; SystemExit passes through.
    """
    with open(config["code_path"], encoding="utf-8", errors="surrogatepass") as f:
        code = f.read()
    sys.stdout.reconfigure(line_buffering=True)  # output before a kill is not lost
    sys.argv = ["<code>"]
    sys.path.insert(0, config["work"])
    if config["audit_hook"]:
        _install_audit_hook(config["work"], config["read_paths"])
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    try:
        exec(compile(code, "<code>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _hide_frames(exc, _run.__code__.co_filename)
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def _hide_frames(exc: BaseException, filename: str) -> None:
    """Drop the sandbox's own frames (this file: `_run`, the audit hook) from the tracebacks
    of `exc` and of the exceptions chained to it, so the code sees only its own."""
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        kept, tb = [], error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename != filename:
                kept.append(tb)
            tb = tb.tb_next
        rebuilt = None
        for tb in reversed(kept):
            rebuilt = types.TracebackType(rebuilt, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
        error.__traceback__ = rebuilt
        stack += [error.__cause__, error.__context__]


# Audit events that create, change or remove a path -> (path index, its dir_fd index) pairs.
_WRITE_EVENTS = {
    "os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
    "os.truncate": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "os.chflags": ((0, None),), "os.lchflags": ((0, None),), "os.lchmod": ((0, None),),
    "os.lchown": ((0, None),),
}  # fmt: skip
_READ_EVENTS = ("os.listdir", "os.scandir")
_SOCKET_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
AF_UNIX = 1


def _install_audit_hook(work: str, read_paths: Sequence[str]) -> None:
    """Deny, at the Python level, what Landlock denies in the kernel (a second layer).

    Writing (open for writing, mkdir, rename, remove, chmod, ...) is allowed only under the
    work directory (and /dev/null); reading (open, listdir, scandir) only there and under the
    read paths; sockets other than unix ones may not connect, bind or send. Paths are
    resolved (symlinks included) before the check. A denial raises PermissionError (EACCES).
    """
    work = os.path.realpath(work)
    writable = (work, *DEVICE_WRITE_PATHS)
    readable = (*writable, *(os.path.realpath(p) for p in read_paths))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            _check(path, writable if writing else readable, "writing" if writing else "reading")
        elif event in _WRITE_EVENTS:
            for index, fd_index in _WRITE_EVENTS[event]:
                dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                _check(args[index], writable, "changing", dir_fd)
        elif event in _READ_EVENTS:
            _check("." if args[0] is None else args[0], readable, "listing")
        elif event in _SOCKET_EVENTS and getattr(args[0], "family", AF_UNIX) != AF_UNIX:
            raise PermissionError(errno.EACCES, "Permission denied (sandbox: no network)")

    sys.addaudithook(hook)


def _check(path: Any, allowed: Sequence[str], action: str, dir_fd: int | None = None) -> None:
    """Raise PermissionError unless `path` resolves to one of `allowed` or beneath one."""
    if isinstance(path, int):
        return  # an open file descriptor: its path was checked when it was opened
    name = os.fsdecode(os.fspath(path))
    if not os.path.isabs(name) and dir_fd is not None and dir_fd >= 0:
        try:
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        except OSError:
            name = "/"  # unknown directory: refuse
    resolved = os.path.realpath(name)
    if any(resolved == root or resolved.startswith(root.rstrip("/") + "/") for root in allowed):
        return
    raise PermissionError(
        errno.EACCES,
        f"Permission denied (sandbox: {action} outside the working directory is not allowed)",
        name,
    )


def _main(argv: Sequence[str]) -> int:
    """`python -I sandbox.py --boot|--run CONFIG_JSON`: the sandbox's own processes."""
    mode, config = argv[0], json.loads(argv[1])
    if mode == "--boot":
        return _boot(config)
    if mode == "--run":
        return _run(config)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
