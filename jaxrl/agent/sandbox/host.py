"""The calling process's side: `run_python` starts the boot, reads the output, leaves nothing.

The program's stdout and stderr come through pipes, of which a capped head and tail are kept
(`_Capture`); the status pipe carries the sandbox's own JSON lines (tree.py). Past the wall
clock plus a grace, this process kills the init's group itself (the backstop), then the boot's
session. The run's directory (`jaxrl_sandbox_*` under the temp dir) holds the code and the
program's working directory, and is removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import linux
from .identity import SANDBOX_HOST_ID, host_ids
from .layers import LAYERS, REQUIRED, SandboxUnavailable, validate

log = logging.getLogger("jaxrl.agent.sandbox")

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
# What the program may read besides its own directory (when they exist): the system's
# libraries and binaries, and the /etc files that the C library and Python's stdlib read.
# Not /etc as a whole (shadow, keys, /etc/ssl/private), /home, /root, /tmp, /proc, /sys, /var.
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
ETC_READ_PATHS = tuple(
    f"/etc/{name}"
    for name in (
        "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd",
        "group", "nsswitch.conf", "hosts", "host.conf", "gai.conf", "mime.types",
        "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "os-release",
    )
)  # fmt: skip
GRACE_S = 3.0  # after the wall-clock limit: then this process kills the init, then the boot
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
    tmp_mb: int = 64,
    env: Mapping[str, str] | None = None,
    extra_read_paths: Sequence[str] = (),
    require: Sequence[str] = REQUIRED,
    allow_weaker_isolation: bool = False,
    sandbox_uid: int = SANDBOX_HOST_ID,
    sandbox_gid: int = SANDBOX_HOST_ID,
    namespaces: bool = True,
    filesystem_view: bool = True,
    landlock: bool = True,
    syscall_filter: bool = True,
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
        max_processes: The program's processes and threads, itself included (RLIMIT_NPROC
            of the sandbox's uid in its user namespace).
        file_size_mb: Largest file the program may write (RLIMIT_FSIZE).
        tmp_mb: Size of the view's private /tmp and /dev/shm (tmpfs) each.
        env: Variables added to the minimal environment.
        extra_read_paths: More paths the program may read (bound into the view read-only).
        require: The layers (names in `LAYERS`) without which the program is not run.
        allow_weaker_isolation: Run even when a required layer is missing (a warning per
            run; the result's `isolation` shows what was applied).
        sandbox_uid, sandbox_gid: The host ids the program runs as when the caller is root
            (a non-root caller's program runs as the caller: the kernel maps no other id).
        namespaces, filesystem_view, landlock, syscall_filter, audit_hook: False turns that
            layer off (tests, debugging); a required one then needs allow_weaker_isolation.
        tmp_dir: Where the run's temporary directory goes (default: the system's).

    Raises:
        SandboxUnavailable: A required layer is missing and weaker isolation is not allowed.
    """
    require = validate(require)
    uid, gid = host_ids(sandbox_uid, sandbox_gid)
    root = tempfile.mkdtemp(prefix="jaxrl_sandbox_", dir=tmp_dir)
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        code_path = os.path.join(root, "code.py")
        with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        os.chmod(code_path, 0o444)  # readable by the sandbox's uid, whatever the umask
        # Writable by whichever uid the program gets (the sandbox's, or the caller's where the
        # machine refuses the identity); no one else can reach it (`root` is 0700).
        os.chmod(work, 0o777)
        config = {
            "work": work,
            "code_path": code_path,
            "timeout_s": float(timeout_s),
            "cpu_s": float(cpu_s),
            "memory_mb": int(memory_mb),
            "file_size_mb": int(file_size_mb),
            "max_processes": int(max_processes),
            "tmp_mb": int(tmp_mb),
            "read_paths": [*default_read_paths(), *map(os.path.abspath, extra_read_paths)],
            "namespaces": namespaces,
            "filesystem_view": filesystem_view,
            "landlock": landlock,
            "syscall_filter": syscall_filter,
            "audit_hook": audit_hook,
            "is_root": os.getuid() == 0,
            "host_uid": uid,
            "host_gid": gid,
            "require": list(require),
            "allow_weaker": bool(allow_weaker_isolation),
            "env": _environment(env),
        }
        result, status = _spawn(config, max_output_bytes)
    finally:
        _remove_tree(root)
    if status.get("refused"):
        raise SandboxUnavailable(status["refused"], _errors(status))
    missing = [layer for layer in require if not result.isolation.get(layer)]
    if missing and result.error is None:
        log.warning(
            "sandbox: ran untrusted code with weaker isolation (allow_weaker_isolation): "
            "missing %s", ", ".join(missing),
        )  # fmt: skip
    return result


def _errors(status: dict[str, Any]) -> str:
    keys = ("identity_error", "view_error", "filter_error")
    return "\n".join(f"{key}: {status[key]}" for key in keys if status.get(key))


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
    }
    # "/" would open everything (an interpreter installed at the root is not supported).
    return sorted(p for p in paths if os.path.abspath(p) != "/" and os.path.exists(p))


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    """The program's whole environment (the runner adds HOME and TMPDIR): nothing inherited."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        # One BLAS/OpenMP thread: a thread pool per process would eat the memory limit.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def _spawn(config: dict[str, Any], max_output_bytes: int) -> tuple[SandboxResult, dict]:
    """Start the boot process, collect its output and status, and leave nothing running."""
    status_r, status_w = os.pipe()
    config["status_fd"] = status_w
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-S", BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=config["work"],
            env=config["env"],
            start_new_session=True,
            pass_fds=(status_w,),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        with proc.stdin:
            proc.stdin.write(json.dumps(config).encode())
    except OSError:
        pass  # the boot died at once: reported as a run without a result
    try:
        deadline = start + config["timeout_s"] + GRACE_S
        out, err, status, backstop = _collect(proc, status_r, max_output_bytes, deadline)
    finally:
        _kill_sandbox(proc.pid, None)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        os.close(status_r)
    result = _result(proc, config, out, err, status, backstop, time.monotonic() - start)
    return result, status


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

    The keeper enforces the wall-clock limit. Past `deadline` (that limit plus a grace)
    this process kills the init's group itself (the backstop: the keeper then reaps the init
    and reports); a grace later, the boot's session too. Once the boot has exited, whatever is
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
            if not swept and linux.exited(proc.pid):
                swept = True
                _kill_sandbox(proc.pid, _parse_status(raw).get("group"))
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return out, err, _parse_status(raw), backstop > 0


def _kill_sandbox(boot_pid: int, group: Any, *, boot: bool = True, scan: bool = False) -> None:
    """SIGKILL the init's process `group`, and (if `boot`) the boot's (if `scan`, its session).

    `group` comes from the status pipe: it is killed only if it is a process group of the
    boot's session, so nothing written there can aim this at another process.
    """
    if isinstance(group, int) and group > 1 and _session(group) == boot_pid:
        linux.killpg(group)
    if boot:
        linux.killpg(boot_pid)
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
        if status.get("refused"):
            error = f"refused: missing {', '.join(status['refused'])}"
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
        isolation={layer: bool(status.get(layer)) for layer in LAYERS},
        error=error,
        pid=proc.pid,
    )


def _exception(stderr: str) -> str | None:
    """The uncaught exception's type: the last line of stderr that names one.

    That is the traceback's last line when one process wrote it. When several did (a fork
    bomb's children all fail at the process limit), their writes interleave and the stream
    may end in another process's "Traceback ..." line or a line cut by the kill, so the last
    line naming an exception is taken, not the last line.
    """
    for line in reversed(stderr.splitlines()):
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match.group(1).rpartition(".")[2]
    return None


def _reason(
    timed_out: bool, sig: int | None, exception: str | None, cpu_s: float | None, cpu_limit: float
) -> str | None:
    """Why the run stopped, when a limit or the sandbox stopped it (see `SandboxResult`)."""
    if timed_out:
        return "timeout"
    # A SIGXCPU the program sent itself is a "signal": the CPU limit needs the CPU time used.
    spent = cpu_s is not None and cpu_s >= 0.9 * math.ceil(cpu_limit)
    if sig in (signal.SIGXCPU, signal.SIGKILL) and spent:
        return "cpu_time"
    if sig is not None:
        return "signal"
    return _EXCEPTION_REASONS.get(exception or "")


def _remove_tree(path: str) -> None:
    """Remove the run's directory, making unreadable or read-only parts writable first.

    Without the file-system view the program writes there (in the view, into a tmpfs): a
    tree deeper than Python's recursion limit goes to `rm -rf`; nothing raises from here.
    """

    def retry(function, failed: str, _exc_info) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    with contextlib.suppress(OSError, RecursionError):
        shutil.rmtree(path, onerror=retry)
    for command in (["chmod", "-R", "u+rwX", "--", path], ["rm", "-rf", "--", path]):
        if not os.path.lexists(path):
            return
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if os.path.lexists(path):
        log.error("sandbox: could not remove the run's directory %s", path)
