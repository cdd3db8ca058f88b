"""The sandbox's own processes, from the boot to the runner's exec.

    boot       python -I -B -S boot.py CONFIG (a new session, the caller's namespaces): forks
    │          the keeper, writes its user namespace's id maps (identity.py), waits for it
    └─ keeper  unshare(user|mount|net|pid|ipc); kills the init's process group at the
       │       wall-clock limit, reaps it, reports on the status pipe
       └─ init     fork: pid 1 of the PID namespace, own process group; caps the namespace's
          │        pid_max; opens the view's sources, becomes the sandbox's uid, builds the
          │        view and pivots into it (fsview.py); turns non-dumpable (its /proc
          │        entries closed to the program's uid); reaps orphans; reports the exit
          └─ runner  fork: rlimits and nice (limits.py), Landlock (landlock.py), the syscall
                     filter (seccomp.py); checks the required layers (refuses to exec if one
                     is missing and weaker isolation is not allowed); exec python -I -B
                     runner.py (the program)

Every process reports JSON lines on the status pipe (`report`), never the program: the pipe is
closed on the runner's exec, so the program cannot write its own verdict.
"""

# try/except instead of contextlib.suppress: the sandbox's processes import as little as they
# can (an interpreter start is most of a call's cost).
# ruff: noqa: SIM105

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

from . import fsview, identity, landlock, limits, linux, seccomp
from .layers import LAYERS

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
# Signals the init ignores (SIGCHLD stays: it reaps; SIGKILL and SIGSTOP cannot be caught).
CATCHABLE = tuple(
    s for s in signal.valid_signals()
    if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD) and s < signal.SIGRTMIN
)  # fmt: skip
NAMESPACES = {
    linux.CLONE_NEWUSER: "user_namespace",
    linux.CLONE_NEWNET: "network_namespace",
    linux.CLONE_NEWPID: "pid_namespace",
    linux.CLONE_NEWIPC: "ipc_namespace",
}


def report(fd: int, **fields: object) -> None:
    """One JSON line on the status pipe (a write below PIPE_BUF is atomic)."""
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
    except OSError:
        pass


def boot(config: dict[str, object]) -> int:
    """The boot process: start the keeper and map its user namespace's ids from outside."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    keeper = os.fork()
    if keeper == 0:
        os.close(ready_r)
        os.close(go_w)
        _run_child(lambda: _keeper(config, ready_w, go_r))
    os.close(ready_w)
    os.close(go_r)
    unshared = json.loads(os.read(ready_r, 4096) or b"{}")
    os.close(ready_r)
    mapped = False
    if unshared.get("user_namespace"):
        try:
            identity.write_id_maps(keeper, config["host_uid"], config["host_gid"])
            mapped = True
        except OSError as exc:
            report(config["status_fd"], identity_error=f"writing the id maps: {exc}")
    try:
        os.write(go_w, b"1" if mapped else b"0")
    except OSError:
        pass
    os.close(go_w)
    os.waitpid(keeper, 0)
    return 0


def _run_child(main) -> None:
    """Run `main` in a forked child and exit with its code (70 on an exception)."""
    code = 70
    try:
        code = main()
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the C hook: no `traceback` import in the sandbox
    finally:
        os._exit(code)


def _keeper(config: dict[str, object], ready_w: int, go_r: int) -> int:
    """Enter the namespaces, wait for the id maps, start the init, enforce the wall clock."""
    fd = config["status_fd"]
    layers = _unshare(config["namespaces"])
    os.write(ready_w, json.dumps(layers).encode())
    os.close(ready_w)
    layers["mapped"] = os.read(go_r, 1) == b"1"
    os.close(go_r)
    report(fd, **{k: v for k, v in layers.items() if k in LAYERS})
    init = os.fork()
    if init == 0:
        _run_child(lambda: _init(config, layers))
    try:
        os.setpgid(init, init)  # the init does it too; whichever runs first
    except OSError:
        pass
    report(fd, group=init)
    timed_out = not _wait_exit(init, config["timeout_s"])
    if timed_out:
        linux.killpg(init)
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.waitid(os.P_PID, init, os.WEXITED | os.WNOWAIT)
    linux.killpg(init)  # what is left of its group (without a PID namespace); its pgid is reserved
    os.waitpid(init, 0)
    report(fd, timed_out=timed_out)
    return 0


def _unshare(enabled: bool) -> dict[str, bool]:
    """Enter new namespaces, the most that works: user+mount+net+pid+ipc first.

    Without unprivileged user namespaces, root still gets net+pid+ipc (keeping its
    capabilities, and no view or identity: see docs/sandbox.md); then a bare network
    namespace; then none.
    """
    layers = dict.fromkeys(NAMESPACES.values(), False)
    every = linux.CLONE_NEWUSER | linux.CLONE_NEWNET | linux.CLONE_NEWPID | linux.CLONE_NEWIPC
    user = linux.CLONE_NEWUSER | linux.CLONE_NEWNS
    attempts = (every | linux.CLONE_NEWNS, every & ~linux.CLONE_NEWUSER, user | linux.CLONE_NEWNET)
    for flags in (*attempts, linux.CLONE_NEWNET) if enabled else ():
        try:
            linux.unshare(flags)
        except OSError:
            continue
        layers.update({name: bool(flags & flag) for flag, name in NAMESPACES.items()})
        break
    return layers


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for child `pid` to exit (leaving it unreaped); True if it did."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3: poll
        while not linux.exited(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return linux.exited(pid)
    try:
        remaining = max(0.0, deadline - time.monotonic())
        return bool(select.select([pidfd], [], [], remaining)[0]) or linux.exited(pid)
    finally:
        os.close(pidfd)


def _init(config: dict[str, object], layers: dict[str, bool]) -> int:
    """The init (pid 1 of the PID namespace when there is one): identity, view, runner, reap.

    It ignores every signal it may (a namespace's init gets from inside only those it
    handles, and Python handles SIGINT); the runner restores them before its exec. When it
    returns, the kernel kills every process left in its PID namespace.
    """
    for number in CATCHABLE:
        signal.signal(number, signal.SIG_IGN)
    os.setpgid(0, 0)
    fd = config["status_fd"]
    if layers["pid_namespace"] and layers["user_namespace"]:
        pid_max = max(limits.PID_MAX_MIN, config["max_processes"] + 2)
        report(fd, pid_limit=limits.set_pid_max(pid_max))
    view = _identity_and_view(config, layers)
    linux.not_dumpable()  # the program shares its uid: /proc/1/fd holds the status pipe
    runner = os.fork()
    if runner == 0:
        try:
            for number in CATCHABLE:
                signal.signal(number, signal.SIG_DFL)
            _exec_runner(config, layers, view)
        except BaseException as exc:
            report(fd, error=f"could not start the runner: {exc!r}")
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
            report(fd, cpu_s=usage.ru_utime + usage.ru_stime, **exit_fields)
            return 0


def _identity_and_view(config: dict[str, object], layers: dict[str, bool]) -> bool:
    """Become the mapped, unprivileged uid and build the view; whether the view was built.

    The two go together: the interpreter may be readable only by the caller (e.g. under
    /root/.pyenv), and the view's binds, opened with the caller's uid, are how the sandbox's
    uid reaches it.
    """
    fd = config["status_fd"]
    if not (config["filesystem_view"] and layers["user_namespace"] and layers["mapped"]):
        layers["unprivileged_identity"] = not config["is_root"]
        report(fd, unprivileged_identity=layers["unprivileged_identity"])
        return False
    files = {
        f"{fsview.EXEC_DIR}/runner.py": RUNNER,
        f"{fsview.EXEC_DIR}/code.py": config["code_path"],
    }
    plan = fsview.open_sources(config["read_paths"], files)
    identity.become_inside_user(config["is_root"])
    layers["unprivileged_identity"] = True
    report(fd, unprivileged_identity=True)
    try:
        proc = fsview.build(plan, config["tmp_mb"])
    except OSError as exc:
        report(fd, view_error=str(exc))
        return False
    report(fd, filesystem_view=True, proc=proc)
    return True


def _exec_runner(config: dict[str, object], layers: dict[str, bool], view: bool) -> None:
    """The runner before its exec: limits, Landlock, the filter, the layer check, exec."""
    fd = config["status_fd"]
    # RLIMIT_NPROC counts the (user namespace, uid) pair's tasks: the init's, and for a
    # non-root caller (whose uid is the program's) the keeper's, are not the program's.
    own = 1 if config["is_root"] else 2
    nproc = config["max_processes"] + own if layers["user_namespace"] else None
    limits.apply(config, nproc)
    exec_files = [RUNNER, config["code_path"]]
    paths = fsview.policy(view, config["work"], config["read_paths"], exec_files)
    applied = dict(landlock.NONE)
    if config["landlock"]:
        applied = landlock.restrict(landlock.rules(paths["read"], paths["write"]))
    applied["syscall_filter"] = False
    if config["syscall_filter"]:
        try:
            seccomp.apply()
            applied["syscall_filter"] = True
        except OSError as exc:
            report(fd, filter_error=str(exc))
    applied["process_limit"] = nproc is not None and layers["unprivileged_identity"]
    applied["audit_hook"] = bool(config["audit_hook"])
    report(fd, **applied)
    have = {**{k: v for k, v in layers.items() if k in LAYERS}, **applied, "filesystem_view": view}
    missing = [layer for layer in config["require"] if not have.get(layer)]
    if missing and not config["allow_weaker"]:
        report(fd, refused=missing)
        os._exit(126)
    os.set_inheritable(fd, False)  # the program never holds the status pipe
    if view:
        code_path, runner_path = f"{fsview.EXEC_DIR}/code.py", f"{fsview.EXEC_DIR}/runner.py"
    else:
        code_path, runner_path = config["code_path"], RUNNER
    runner_config = {
        "work": paths["work"], "code_path": code_path, "read": paths["read"],
        "write": paths["write"], "audit_hook": config["audit_hook"],
    }  # fmt: skip
    env = {**config["env"], "HOME": paths["work"], "TMPDIR": paths["work"]}
    os.chdir(paths["work"])
    argv = [sys.executable, "-I", "-B", runner_path, json.dumps(runner_config)]
    os.execve(sys.executable, argv, env)
