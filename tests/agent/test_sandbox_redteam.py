"""Red team: attacks on the code sandbox, each judged from the host side.

Every attack runs first unconfined, as a control that must succeed (the attack works on this
machine, so its failure in the sandbox means something), then confined with the defaults
(every layer required), and is judged from outside: a canary file that must not appear or
change, a server that must not receive a token, a process that must still be alive. Each runs
as the test's own uid (root in CI) and, where the tests run as root, as an ordinary user
(uid 4321, through tests/agent/_as_user.py). A few attacks also run with one layer alone,
to show what each layer stops by itself. Every attack is bounded in time, processes and
memory, and removes what it creates.
"""

import errno
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
from _procs import assert_session_empty

from jaxrl.agent.sandbox import REQUIRED, SandboxUnavailable, isolation, probes, run_python
from jaxrl.agent.tools.code import CodeInterpreter
from jaxrl.rewards.custom import load_custom_reward_fn
from jaxrl.rewards.parallel import ScoringPool

pytestmark = pytest.mark.sandbox

USER = 4321  # the ordinary user: no account needed
AS_USER = pathlib.Path(__file__).with_name("_as_user.py")
REPO = pathlib.Path(__file__).parents[2]
LIMITS = {"timeout_s": 10, "cpu_s": 5, "memory_mb": 512, "max_output_bytes": 16384}
RESULT_FIELDS = ("stdout", "stderr", "exit_code", "signal", "timed_out", "killed_reason",
                 "exception", "isolation", "error", "pid")  # fmt: skip


class Caller:
    """Who calls the sandbox: the test process itself, or an ordinary user (via _as_user.py).

    `confined` returns run_python's result fields (or {"refused": [...], "message": ...});
    `unconfined` runs the same code as a plain `python -I -c` of that uid.
    """

    def __init__(self, uid: int | None):
        self.uid = os.getuid() if uid is None else uid
        self.other = uid is not None

    def confined(self, code: str, **kwargs) -> dict:
        kwargs = {**LIMITS, **kwargs}
        if self.other:
            return self._as_user("confined", {"code": code, "kwargs": kwargs})
        try:
            result = run_python(code, **kwargs)
        except SandboxUnavailable as exc:
            return {"refused": exc.missing, "message": str(exc)}
        return {name: getattr(result, name) for name in RESULT_FIELDS}

    def unconfined(self, code: str, pass_fds=()) -> dict:
        """Run `code` unconfined in a fresh directory of this caller's (removed afterwards)."""
        cwd = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl_redteam_cwd_"))
        self.own(cwd, 0o700)
        try:
            if self.other:
                request = {"code": code, "pass_fds": pass_fds, "cwd": str(cwd)}
                return self._as_user("unconfined", request, pass_fds)
            done = subprocess.run(
                [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30,
                pass_fds=pass_fds, cwd=cwd,
            )  # fmt: skip
            return {"stdout": done.stdout, "stderr": done.stderr, "exit_code": done.returncode}
        finally:
            shutil.rmtree(cwd, ignore_errors=True)

    def _as_user(self, mode: str, request: dict, pass_fds=()) -> dict:
        done = subprocess.run(
            [sys.executable, "-I", str(AS_USER), str(self.uid), mode, json.dumps(request)],
            capture_output=True, text=True, timeout=60, pass_fds=pass_fds,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    def own(self, path: pathlib.Path, mode: int) -> pathlib.Path:
        """Make `path` this caller's, with `mode`: a file or service of the caller's own."""
        os.chown(path, self.uid, self.uid)
        os.chmod(path, mode)
        return path


@pytest.fixture(params=["test_uid", "ordinary_user"])
def caller(request) -> Caller:
    if request.param == "ordinary_user":
        if os.getuid() != 0:
            pytest.skip("becoming another user needs root; the tests' own uid is the ordinary user")
        return Caller(USER)
    return Caller(None)


@pytest.fixture
def outside(caller):
    """A private directory of the caller's outside the sandbox (0700, under the host's /tmp)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl_redteam_", dir="/tmp"))
    caller.own(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def lines(result: dict) -> dict[str, str]:
    """The program's `LABEL VALUE` lines as a dict."""
    pairs = (line.split(" ", 1) for line in result["stdout"].splitlines() if " " in line)
    return {label: value for label, value in pairs}


ATTEMPT = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def attempt(label, action):
    try:
        value = action()
    except OSError as error:
        print(label, "ERR", error.errno, flush=True)
    else:
        print(label, "OK", value, flush=True)
def c_call(name, *args):
    result = getattr(libc, name)(*args)
    if result == -1:
        raise OSError(ctypes.get_errno(), name)
    return result
def in_child(action):
    # Run `action` in a forked child that exits at once: 0, or the errno it failed with.
    pid = os.fork()
    if pid == 0:
        try:
            action()
        except OSError as error:
            os._exit(error.errno or 255)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        raise OSError(code, "in the child")
    return 0
"""


def assert_ran_confined(result: dict) -> None:
    """The program ran (no refusal, no sandbox error) with every required layer."""
    assert "refused" not in result, result
    assert result["error"] is None, result
    assert all(result["isolation"][layer] for layer in REQUIRED), result["isolation"]


# ------------------------------------------------------------------------ host unix sockets


class TokenServer:
    """A unix-socket server of the caller's (a 0600 socket in a 0700 directory, or an
    abstract name) that records every byte it receives."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.received = bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    while data := conn.recv(4096):
                        self.received += data
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_host_unix_sockets_are_unreachable(caller, outside):
    (outside / "service").mkdir()
    service = caller.own(outside / "service", 0o700)
    path = str(service / "sock")
    abstract = f"\0jaxrl-redteam-{uuid.uuid4().hex}"
    servers = [TokenServer(path), TokenServer(abstract)]
    caller.own(pathlib.Path(path), 0o600)
    try:

        def attack(token: str) -> str:
            return ATTEMPT + (
                "import socket\n"
                "def send(address):\n"
                "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "    s.settimeout(2)\n"
                "    s.connect(address)\n"
                f"    s.sendall({token!r}.encode())\n"
                "    s.close()\n"
                f"attempt('path', lambda: send({path!r}))\n"
                f"attempt('abstract', lambda: send({abstract!r}))\n"
            )

        control, token = caller.unconfined(attack("CONTROL")), f"TOKEN-{uuid.uuid4().hex}"
        deadline = time.monotonic() + 5
        while any(b"CONTROL" not in s.received for s in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(b"CONTROL" in s.received for s in servers), control
        result = caller.confined(attack(token))
        assert_ran_confined(result)
        time.sleep(0.3)
        assert all(token.encode() not in s.received for s in servers)
        assert lines(result)["path"].startswith("ERR") and lines(result)["abstract"].startswith(
            "ERR"
        )
    finally:
        for server in servers:
            server.close()


FORKSERVER = """
import multiprocessing as mp, sys, time
from multiprocessing import forkserver
ctx = mp.get_context("forkserver")
p = ctx.Process(target=int)
p.start(); p.join()
print(forkserver._forkserver._forkserver_address, flush=True)
time.sleep(30)
"""


def test_a_forkserver_socket_is_unreachable_and_the_reward_pool_starts_none(tmp_path):
    """The issue's escape: a multiprocessing fork server's socket (root's, 0700 directory)
    runs whatever pickle connects. The sandbox reaches no such socket, and the reward pool
    (ScoringPool) starts its workers without one."""
    server = subprocess.Popen(
        [sys.executable, "-I", "-c", FORKSERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        address = server.stdout.readline().strip()
        assert os.path.exists(address)
        code = (
            "import socket\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({address!r}); print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('ERR', e.errno)\n"
        )
        control = Caller(None).unconfined(code)
        assert control["stdout"].strip() == "CONNECTED", control
        result = Caller(None).confined(code)
        assert_ran_confined(result)
        assert result["stdout"].startswith("ERR"), result
    finally:
        server.kill()
        server.wait()
    before = listening_unix_sockets()
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def compute_score(x):\n    return float(x * x)\n")
    pool = ScoringPool(load_custom_reward_fn(str(scorer), "compute_score"), 1, timeout_s=60)
    try:
        assert [r.value for r in pool.map([{"x": 2}])] == [4.0]
        assert listening_unix_sockets() - before == set()  # no new listener on the host
    finally:
        pool.close()


def listening_unix_sockets() -> set[str]:
    """Paths of the host's listening unix sockets (/proc/net/unix, flag __SO_ACCEPTCON)."""
    found = set()
    with open("/proc/net/unix") as f:
        for row in f.read().splitlines()[1:]:
            fields = row.split()
            if len(fields) >= 8 and int(fields[3], 16) & 0x10000 and fields[7].startswith("/"):
                found.add(fields[7])
    return found


# ---------------------------------------------------------------------- files outside


def file_attack(secret: pathlib.Path, targets: list[pathlib.Path], python_only: bool) -> str:
    """Read `secret` and create each target, by Python, ctypes, a shell and a symlink."""
    code = ATTEMPT + f"attempt('read', lambda: open({str(secret)!r}).read())\n"
    code += f"attempt('listdir', lambda: os.listdir({str(secret.parent)!r}))\n"
    for i, target in enumerate(targets):
        code += f"attempt('write{i}', lambda: open({str(target) + '.py'!r}, 'w').write('x'))\n"
        if not python_only:
            flags = os.O_WRONLY | os.O_CREAT
            code += (
                f"attempt('cwrite{i}', lambda: c_call('open', {str(target) + '.c'!r}.encode(), "
                f"{flags}, 0o644))\n"
                f"attempt('shell{i}', lambda: __import__('subprocess').run(['/bin/sh', '-c', "
                f"'echo x > {target}.sh'], check=True))\n"
            )
    if not python_only:
        code += (
            f"attempt('cread', lambda: os.read(c_call('open', {str(secret)!r}.encode(), 0), 99))\n"
            f"attempt('symlink', lambda: os.symlink({str(secret.parent)!r}, 'link'))\n"
            f"attempt('via_link', lambda: open('link/{secret.name}').read())\n"
        )
    return code


def created(targets: list[pathlib.Path]) -> list[str]:
    found = []
    for target in targets:
        for suffix in (".py", ".c", ".sh"):
            path = pathlib.Path(f"{target}{suffix}")
            if path.exists():
                found.append(str(path))
                path.unlink()
    return found


def test_files_outside_can_be_neither_read_nor_written(caller, outside):
    secret_text = f"SECRET-{uuid.uuid4().hex}"
    secret = outside / "id_rsa"
    secret.write_text(secret_text)
    caller.own(secret, 0o600)
    name = f"jaxrl_redteam_{uuid.uuid4().hex}"
    targets = [outside / name, pathlib.Path("/tmp") / name]
    if not caller.other:
        targets.append(REPO / name)  # the repository: writable by the test's uid only
    code = file_attack(secret, targets, python_only=False)
    control = caller.unconfined(code)
    assert secret_text in control["stdout"]
    assert len(created(targets)) == 3 * len(targets), control
    result = caller.confined(code)
    assert_ran_confined(result)
    assert secret_text not in result["stdout"] + result["stderr"]
    assert created(targets) == [], result


# Each layer alone (the test's uid): what it stops by itself. The audit hook is no boundary
# (ctypes and child processes bypass it): it is attacked with Python-level calls only.
ALONE = {
    "view": {"landlock": False, "audit_hook": False},
    "landlock": {"filesystem_view": False, "audit_hook": False, "allow_weaker_isolation": True},
    "audit_hook": {
        "namespaces": False, "landlock": False, "syscall_filter": False,
        "allow_weaker_isolation": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("layer", list(ALONE))
def test_each_file_layer_alone_keeps_files_outside(layer, tmp_path):
    if layer == "landlock" and not isolation()["landlock_fs"]:
        pytest.skip("no Landlock on this machine")
    caller = Caller(None)
    outside = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl_redteam_", dir="/tmp"))
    try:
        secret_text = f"SECRET-{uuid.uuid4().hex}"
        secret = outside / "id_rsa"
        secret.write_text(secret_text)
        targets = [outside / f"jaxrl_redteam_{uuid.uuid4().hex}"]
        result = caller.confined(
            file_attack(secret, targets, python_only=layer == "audit_hook"), **ALONE[layer]
        )
        assert result["error"] is None and "refused" not in result, result
        assert secret_text not in result["stdout"] + result["stderr"]
        assert created(targets) == [], result
    finally:
        shutil.rmtree(outside)


def test_root_only_files_in_read_paths_are_unreadable(caller, outside):
    if caller.uid != 0:
        pytest.skip("an ordinary user's program runs as that user: only root has root's files")
    public = outside / "public"
    public.mkdir(mode=0o755)
    os.chmod(outside, 0o755)
    secret_text = f"SECRET-{uuid.uuid4().hex}"
    (public / "key").write_text(secret_text)
    os.chmod(public / "key", 0o600)  # root's, in a directory the program may read
    code = ATTEMPT + (
        f"attempt('key', lambda: open({str(public / 'key')!r}).read())\n"
        "attempt('ssl_private', lambda: os.path.exists('/etc/ssl/private'))\n"
    )
    control = caller.unconfined(code)
    assert secret_text in control["stdout"]
    result = caller.confined(code, extra_read_paths=[str(public)])
    assert_ran_confined(result)
    assert secret_text not in result["stdout"] + result["stderr"]
    assert lines(result)["key"] == f"ERR {errno.EACCES}", result
    assert lines(result)["ssl_private"] == "OK False", result  # not in the view at all


def test_outside_metadata_cannot_change(caller, outside):
    canary = outside / "canary"

    def fresh() -> os.stat_result:
        canary.unlink(missing_ok=True)
        canary.write_text("canary")
        caller.own(canary, 0o600)
        return os.stat(canary)

    path = str(canary)
    code = ATTEMPT + (
        "import subprocess\n"
        f"attempt('chmod', lambda: c_call('chmod', {path!r}.encode(), 0o4755))\n"
        f"attempt('utimes', lambda: c_call('utimes', {path!r}.encode(), None))\n"
        f"attempt('xattr', lambda: c_call('setxattr', {path!r}.encode(), b'user.jaxrl', b'x', 1,"
        " 0))\n"
        f"attempt('bin_chmod', lambda: subprocess.run(['chmod', '4755', {path!r}], check=True))\n"
        f"attempt('bin_touch', lambda: subprocess.run(['touch', '-d', '2001-01-01', {path!r}],"
        " check=True))\n"
    )  # fmt: skip
    before = fresh()
    os.utime(canary, ns=(10**18, 10**18))
    before = os.stat(canary)
    control = caller.unconfined(code)
    after = os.stat(canary)
    assert after.st_mode != before.st_mode and after.st_mtime_ns != before.st_mtime_ns, control
    assert os.listxattr(canary) == ["user.jaxrl"], control
    before = fresh()
    os.utime(canary, ns=(10**18, 10**18))
    before = os.stat(canary)
    result = caller.confined(code)
    assert_ran_confined(result)
    after = os.stat(canary)
    assert (after.st_mode, after.st_mtime_ns, after.st_uid) == (
        before.st_mode, before.st_mtime_ns, before.st_uid,
    ), result  # fmt: skip
    assert os.listxattr(canary) == []


INOTIFY = (
    ATTEMPT
    + """
import select, struct
def watch(paths, seconds):
    fd = c_call("inotify_init1", 0)
    for path in paths:
        attempt("watch " + path, lambda: c_call("inotify_add_watch", fd, path.encode(), 0x100))
    print("WATCHING", flush=True)
    names, deadline = [], __import__("time").monotonic() + seconds
    while select.select([fd], [], [], max(0, deadline - __import__("time").monotonic()))[0]:
        data = os.read(fd, 65536)
        while data:
            wd, mask, cookie, size = struct.unpack("iIII", data[:16])
            names.append(data[16:16 + size].rstrip(b"\\0").decode())
            data = data[16 + size:]
    print("NAMES", " ".join(names))
print("SELF", os.readlink("/proc/self"))
"""
)


def test_names_outside_do_not_leak(caller, outside):
    (outside / "private").mkdir()
    private = caller.own(outside / "private", 0o700)
    code = INOTIFY + f"watch([{str(private)!r}, '/tmp'], 2.5)\n"

    def run_while_names_appear(run) -> tuple[dict, list[str]]:
        box, made = {}, []
        thread = threading.Thread(target=lambda: box.update(run(code)))
        thread.start()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            time.sleep(0.3)
            made.append(f"name-{uuid.uuid4().hex}")
            (private / made[-1]).touch()
        thread.join(30)
        return box, made

    control, made = run_while_names_appear(caller.unconfined)
    assert set(made) & set(lines(control)["NAMES"].split()), control
    assert int(lines(control)["SELF"]) > 10  # the host's pid
    result, made = run_while_names_appear(caller.confined)
    assert_ran_confined(result)
    names = lines(result).get("NAMES", "").split()
    assert not set(made) & set(names) and not any(n.startswith("jaxrl_") for n in names), result
    assert int(lines(result)["SELF"]) <= 10  # its own PID namespace's pid, not the host's


# --------------------------------------------------------------------- other processes


@pytest.fixture
def sleeper(caller):
    """A process of the caller's own (which the caller itself may signal and trace)."""
    process = subprocess.Popen(["sleep", "60"], user=caller.uid, group=caller.uid)
    yield process
    process.kill()
    process.wait()


def tracer(pid: int) -> int:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(status.split("TracerPid:")[1].split()[0])


def test_host_processes_can_be_neither_signalled_nor_traced(caller, sleeper):
    pid = sleeper.pid
    code = ATTEMPT + (
        f"attempt('ptrace', lambda: c_call('ptrace', 16, {pid}, None, None))\n"  # ATTACH
        "import time; time.sleep(0.2)\n"
        f"attempt('detach', lambda: c_call('ptrace', 17, {pid}, None, None))\n"
        f"attempt('pidfd', lambda: os.pidfd_open({pid}))\n"
        f"attempt('stop', lambda: os.kill({pid}, 19))\n"  # SIGSTOP, undone below
        f"attempt('cont', lambda: os.kill({pid}, 18))\n"
    )
    control = caller.unconfined(code)
    assert lines(control)["ptrace"] == "OK 0" and lines(control)["stop"] == "OK None", control
    assert sleeper.poll() is None and tracer(pid) == 0
    code += f"attempt('kill', lambda: os.kill({pid}, 9))\n"
    if isolation()["pid_namespace"]:
        code += "attempt('kill_all', lambda: os.kill(-1, 9))\n"  # its own namespace only
    result = caller.confined(code)
    assert_ran_confined(result)
    assert sleeper.poll() is None and tracer(pid) == 0, result
    assert pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "T"
    for label in ("ptrace", "pidfd", "stop", "kill"):
        assert lines(result)[label].startswith("ERR"), result


# Calls the filter denies, with arguments that reach the kernel's implementation
# unconfined (there they fail with another errno, or succeed harmlessly).
FILTERED = {
    "ptrace_traceme": "in_child(lambda: c_call('ptrace', 0, 0, None, None))",
    "keyctl": "c_call('syscall', NR['keyctl'], 0, -3, 0)",  # the session keyring's id
    "mount": "c_call('syscall', NR['mount'], None, None, None, 0, None)",
    "bpf": "c_call('syscall', NR['bpf'], 9999, None, 0)",
    "perf_event_open": "c_call('syscall', NR['perf_event_open'], None, 0, -1, -1, 0)",
    "userfaultfd": "c_call('syscall', NR['userfaultfd'], 0xFFFF)",
    "io_uring_setup": "c_call('syscall', NR['io_uring_setup'], 0, None)",
    "process_vm_readv": (
        "c_call('syscall', NR['process_vm_readv'], os.getpid(), None, 0, None, 0, 0)"
    ),
    # clone(CLONE_NEWNET | SIGCHLD) as a fork: the child exits at once.
    "clone_newnet": "(lambda pid: os._exit(0) if pid == 0 else os.waitpid(pid, 0)[0] > 0)("
    "c_call('syscall', NR['clone'], 0x40000000 | 17, None, None, None, None))",
    "unshare_in_child": "in_child(lambda: c_call('syscall', NR['unshare'], 0x10000000))",
    "vsock": "__import__('socket').socket(40, 1)",
    "socketpair_vsock": "__import__('socket').socketpair(40)",
    # Memory no rlimit counts; IPC_PRIVATE, size 0 (EINVAL unconfined: no segment is made).
    "memfd_create": "os.memfd_create('x')",
    "memfd_secret": "c_call('syscall', NR['memfd_secret'], 0)",
    "dnotify": "__import__('fcntl').fcntl(os.open('.', os.O_RDONLY), 0x402, 4)",  # DN_CREATE
    "shmget": "c_call('syscall', NR['shmget'], 0, 0, 0o1600)",
    # Watching and locking bound host files; another process's limits.
    "inotify_init1": "c_call('inotify_init1', 0)",
    "flock": "__import__('fcntl').flock(open('lock', 'w'), 2)",
    "prlimit_parent": "__import__('resource').prlimit(os.getppid(), 7)",
}  # fmt: skip


def syscall_numbers() -> dict[str, int]:
    import ctypes

    lib = ctypes.CDLL("libseccomp.so.2")
    names = ("unshare", "keyctl", "mount", "bpf", "perf_event_open", "userfaultfd",
             "io_uring_setup", "process_vm_readv", "clone", "shmget", "memfd_secret")  # fmt: skip
    return {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in names}


def test_the_syscall_filter_returns_an_error_for_each_denied_call(caller):
    if not isolation()["syscall_filter"]:
        pytest.skip("no seccomp filter on this machine (the refusal tests cover it)")
    code = (
        ATTEMPT
        + f"NR = {syscall_numbers()!r}\n"
        + "".join(f"attempt({label!r}, lambda: {call})\n" for label, call in FILTERED.items())
    )
    control = caller.unconfined(code)
    reached = {k for k, v in lines(control).items() if v != f"ERR {errno.EPERM}" and k in FILTERED}
    # Unconfined, most calls reach their implementation (some hosts restrict a few, e.g.
    # kernel.unprivileged_bpf_disabled for a user, no vsock module).
    assert len(reached) >= len(FILTERED) // 2, control
    result = caller.confined(code)
    assert_ran_confined(result)
    outcome = lines(result)
    for label in FILTERED:
        expected = f"ERR {errno.EAFNOSUPPORT if 'vsock' in label else errno.EPERM}"
        assert outcome[label] == expected, (label, result)


# --------------------------------------------------------------- runaways and inheritance


RUNAWAYS = {
    # A fork storm whose children leave the session and ignore failures.
    "fork_storm": (
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
        "    except OSError:\n        pass\n",
        ("processes", "cpu_time", "timeout"),
    ),
    "memory": ("x = bytearray(10 * 1024**3)", ("memory",)),
    "output_flood": (
        "import sys\nwhile True: sys.stdout.write('y' * 65536)", ("cpu_time", "timeout"),
    ),
    "orphans": (
        "import subprocess\nfor _ in range(3):\n"
        "    subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print('started')",
        (None,),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RUNAWAYS))
def test_runaway_programs_are_bounded_and_leave_nothing(caller, name):
    code, reasons = RUNAWAYS[name]
    start = time.monotonic()
    result = caller.confined(code, timeout_s=2, cpu_s=1, max_output_bytes=1000)
    assert result["killed_reason"] in reasons, result
    assert time.monotonic() - start < 2 + 10
    assert len(result["stdout"]) < 1100
    assert_session_empty(result["pid"])


def test_the_program_cannot_forge_its_verdict(caller):
    """The status pipe is the sandbox's: the init holds it, non-dumpable and with
    capabilities the program lacks, so /proc/1/fd is closed to it; the init ignores signals."""
    code = ATTEMPT + (
        "attempt('list', lambda: os.listdir('/proc/1/fd'))\n"
        "for fd in range(3, 16):\n"
        "    attempt(f'forge{fd}', lambda: os.write(os.open(f'/proc/1/fd/{fd}', os.O_WRONLY),"
        ' b\'{"exit_code": 0, "signal": null}\\n\'))\n'
        "attempt('kill_init', lambda: os.kill(1, 9))\n"
        "print('caps', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "raise SystemExit(3)\n"
    )
    result = caller.confined(code, audit_hook=False)
    assert result["exit_code"] == 3 and result["error"] is None, result  # not forged to 0
    assert lines(result)["list"] == f"ERR {errno.EACCES}", result
    assert not any(v.startswith("OK") for k, v in lines(result).items() if k.startswith("forge"))
    assert lines(result)["caps"] == "0000000000000000", result  # no capability at all
    # Without Landlock's scoping (older kernels), the init still ignores the program's
    # signals, and its command line does not carry the sandbox's config.
    code = (
        "import os\nos.kill(1, 2)\nos.kill(1, 15)\nos.kill(1, 1)\n"
        "print(open('/proc/1/cmdline', 'rb').read())\nraise SystemExit(3)\n"
    )
    result = caller.confined(code, audit_hook=False, landlock=False)
    assert result["exit_code"] == 3 and result["error"] is None, result
    assert b"read_paths" not in result["stdout"].encode() and "boot.py" in result["stdout"]
    # A SIGXCPU it sends itself is not the CPU limit (the CPU time it used is read outside).
    result = caller.confined("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)")
    assert (result["signal"], result["killed_reason"]) == (signal.SIGXCPU, "signal"), result


def test_processes_are_capped_also_for_root(caller):
    """RLIMIT_NPROC binds the program's uid, which is not root even when the trainer is."""
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\n"
        "except OSError as error:\n    print('forked', n, error.errno)\n"
    )
    result = caller.confined(code, max_processes=16, timeout_s=5)
    assert result["isolation"]["process_limit"], result
    assert result["stdout"] == f"forked 15 {errno.EAGAIN}\n", result  # and the program: 16


DISK = (
    "import os\nfor _ in range(1100):\n    os.mkdir('d')\n    os.chdir('d')\n"
    "try:\n    for i in range(3):\n        open(f'f{i}', 'wb').write(b'x' * 64 * 2**20)\n"
    "except OSError as error:\n    print('ERR', error.errno)\n"
)


@pytest.mark.parametrize("view", [True, False], ids=["view", "no_view"])
def test_a_deep_tree_and_big_files_leave_nothing_on_the_host(view, tmp_path):
    """In the view the program writes into tmpfs (`tmp_mb`: ENOSPC past it), gone with its
    mount namespace; without it, into the host's run directory, which is still removed (a
    tree deeper than Python's recursion limit included) and the call does not raise."""
    extra = {} if view else {"filesystem_view": False, "allow_weaker_isolation": True}
    result = run_python(DISK, **LIMITS, tmp_dir=str(tmp_path), **extra)
    assert result.error is None, result
    if view:
        assert result.stdout == f"ERR {errno.ENOSPC}\n", result
    assert list(tmp_path.iterdir()) == []


def test_the_callers_environment_and_descriptors_do_not_pass(caller, outside, monkeypatch):
    secret_text = f"SECRET-{uuid.uuid4().hex}"
    monkeypatch.setenv("JAXRL_REDTEAM_SECRET", secret_text)
    secret = outside / "token"
    secret.write_text(secret_text)
    caller.own(secret, 0o600)
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    code = (
        "import os\n"
        "print(os.environ.get('JAXRL_REDTEAM_SECRET'))\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        print(fd, os.pread(fd, 100, 0))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    try:
        control = caller.unconfined(code, pass_fds=(fd,))
        assert control["stdout"].count(secret_text) == 2, control  # env and descriptor
        if caller.other:
            result = caller._as_user("confined", {"code": code, "kwargs": LIMITS}, (fd,))
        else:
            result = caller.confined(code)
    finally:
        os.close(fd)
    assert_ran_confined(result)
    assert secret_text not in result["stdout"] + result["stderr"], result


# ------------------------------------------------------------------ failing closed


# Each switch turns a layer off as a machine without it would; the defaults require it.
SWITCHES = {
    "syscall_filter": {"syscall_filter": False},
    "filesystem_view": {"filesystem_view": False},
    "network_namespace": {"namespaces": False},
}


@pytest.mark.parametrize("layer", list(SWITCHES))
def test_a_missing_required_layer_refuses_to_run(caller, outside, layer, caplog):
    mark = outside / "ran"
    code = f"open({str(mark)!r}, 'w').write('ran')\nprint('ran')"
    weaker = {**SWITCHES[layer], "landlock": False, "audit_hook": False}
    result = caller.confined(code, **weaker)
    assert layer in result["refused"], result
    assert (
        f"- {layer}: needs " in result["message"] and "allow_weaker_isolation" in result["message"]
    )
    assert not mark.exists()  # the program never ran
    with caplog.at_level(logging.WARNING, logger="jaxrl.agent.sandbox"):
        result = caller.confined("print('ran')", **weaker, allow_weaker_isolation=True)
    assert result["stdout"] == "ran\n" and result["isolation"][layer] is False, result
    if not caller.other:
        assert any(layer in record.getMessage() for record in caplog.records)


def test_the_tool_refuses_to_start_without_a_required_layer(monkeypatch, caplog):
    layers = {**isolation(), "syscall_filter": False}
    monkeypatch.setattr(probes, "isolation", lambda: dict(layers))
    with pytest.raises(SandboxUnavailable, match="syscall_filter: needs seccomp") as error:
        CodeInterpreter({"type": "native"})
    assert error.value.missing == ["syscall_filter"] and "libseccomp" in str(error.value)
    with caplog.at_level(logging.WARNING, logger="jaxrl.agent"):
        tool = CodeInterpreter({"type": "native", "allow_weaker_isolation": True})
    assert tool.isolation_options["allow_weaker_isolation"] is True
    assert any("syscall_filter" in record.getMessage() for record in caplog.records)
    for weaker in (False, True):
        with pytest.raises(ValueError, match="unknown sandbox layer"):
            CodeInterpreter(
                {
                    "type": "native",
                    "required_isolation": ["firewall"],
                    "allow_weaker_isolation": weaker,
                }
            )
    with pytest.raises(ValueError, match="sandbox_uid must be an unprivileged id"):
        CodeInterpreter({"type": "native", "sandbox_uid": 0})
