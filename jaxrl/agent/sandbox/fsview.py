"""The program's own file-system view: a mount namespace whose root is a fresh tmpfs.

    /                   tmpfs, read-only once built
    ├─ <read paths>     read-only binds (nosuid, nodev) of the interpreter's prefix, the system
    │                   libraries and binaries, a few /etc files, at their host paths
    ├─ /etc/passwd, /etc/group, /etc/hosts   written here: one user, `sandbox` (uid 1000)
    ├─ /sandbox         the program's directory (tmpfs, 0700): cwd, HOME, TMPDIR
    ├─ /.sandbox        runner.py and code.py (read-only binds)
    ├─ /tmp, /dev/shm   private tmpfs (1777)
    │                   (the three tmpfs `tmp_mb` each: nothing the program writes reaches
    │                   the host's disk, and all of it is gone with the mount namespace)
    ├─ /dev/{null,zero,urandom,random}   binds of the host's nodes; /dev/fd -> /proc/self/fd
    └─ /proc            proc of the sandbox's own PID namespace, `subset=pid` (no /proc/sys)

No host socket file, no host /tmp, /home, /root or /proc exists in it, so `connect()`,
inotify, and metadata calls (chmod, utime, xattrs) on host paths have nothing to act on (the
bound host files are read-only; watching or flock-ing them the syscall filter refuses).

It is built in two phases inside the new user and mount namespaces (the init process):
`open_sources` opens every bind source as an `O_PATH` descriptor while the process still
has the caller's uid (which may be the only one allowed to traverse to them, e.g.
`/root/.pyenv`); after the switch to the sandbox's uid, `build` mounts the tmpfs (owned by
that uid), binds the sources through `/proc/self/fd/N`, and pivots into it.
"""

from __future__ import annotations

import os
import stat

from . import linux

VIEW_MOUNT = "/tmp"  # where the view is built, in the new mount namespace only
WORK = "/sandbox"
EXEC_DIR = "/.sandbox"
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
PRIVATE_TMPFS = {"/tmp": "1777", "/dev/shm": "1777", WORK: "0700"}  # path: mode
GENERATED = {
    "/etc/passwd": "sandbox:x:1000:1000:sandbox:/sandbox:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "/etc/group": "sandbox:x:1000:\nnogroup:x:65534:\n",
    "/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
}
_RO = linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NODEV


class Source:
    """A bind: `fd` (O_PATH, opened with the caller's uid) mounted at `target` in the view."""

    __slots__ = ("fd", "is_dir", "target", "writable")

    def __init__(self, fd: int, target: str, writable: bool, is_dir: bool):
        self.fd, self.target, self.writable, self.is_dir = fd, target, writable, is_dir


class Plan:
    """The binds and the symlinks ((path in the view, its target)) of a view."""

    __slots__ = ("sources", "symlinks")

    def __init__(self, sources: list[Source], symlinks: list[tuple[str, str]]):
        self.sources, self.symlinks = sources, symlinks


def open_sources(read_paths: list[str], exec_files: dict[str, str]) -> Plan:
    """Phase 1 (the caller's uid): open every bind source; dedupe nested read paths.

    A read path that is a symlink (e.g. /lib -> usr/lib on merged-/usr systems) becomes a
    symlink in the view to its resolved path, which is bound.
    """
    resolved, symlinks = [], []
    for path in read_paths:
        path = os.path.abspath(path)
        if path in GENERATED or path in DEVICES or not os.path.lexists(path):
            continue
        real = os.path.realpath(path)
        if real != path:
            symlinks.append((path, real))
        resolved.append(real)
    binds: list[str] = []
    for real in sorted(set(resolved)):
        if not any(real.startswith(parent.rstrip("/") + "/") for parent in binds):
            binds.append(real)
    sources = [_open(path, path, writable=False) for path in binds]
    sources += [_open(source, target, writable=False) for target, source in exec_files.items()]
    sources += [_open(device, device, writable=device == "/dev/null") for device in DEVICES]
    return Plan([s for s in sources if s is not None], symlinks)


def _open(source: str, target: str, *, writable: bool) -> Source | None:
    try:
        fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    return Source(fd, target, writable, stat.S_ISDIR(os.fstat(fd).st_mode))


def build(plan: Plan, tmp_mb: int) -> bool:
    """Phase 2 (the sandbox's uid, capabilities in its namespaces): mount and pivot.

    Returns whether /proc was mounted (a kernel may refuse proc in a user namespace when the
    host's /proc is partly hidden; the view then has none).
    """
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("tmpfs", VIEW_MOUNT, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=0755")
    for path, mode in PRIVATE_TMPFS.items():  # first: a read path under /tmp is bound inside
        os.makedirs(_in_view(path))
        options = f"mode={mode},size={int(tmp_mb)}m,nr_inodes=16384"
        linux.mount("tmpfs", _in_view(path), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, options)
    for source in plan.sources:
        _bind(source)
    for path, target in plan.symlinks:
        _symlink(path, target)
    for path, text in GENERATED.items():
        os.makedirs(os.path.dirname(_in_view(path)), exist_ok=True)
        with open(_in_view(path), "w") as f:
            f.write(text)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", _in_view(f"/dev/{name}"))
    os.symlink("/proc/self/fd", _in_view("/dev/fd"))
    has_proc = _mount_proc()
    linux.pivot_into(VIEW_MOUNT)
    linux.mount_setattr("/", _RO, recursive=False)
    return has_proc


def _in_view(path: str) -> str:
    return VIEW_MOUNT + path


def _bind(source: Source) -> None:
    target = _in_view(source.target)
    if source.is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "a"):
            pass
    linux.mount(f"/proc/self/fd/{source.fd}", target, None, linux.MS_BIND | linux.MS_REC)
    os.close(source.fd)
    if source.target in DEVICES:  # the host's nodes: nodev would make them unusable
        if not source.writable:
            linux.mount_setattr(target, linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID)
        return
    linux.mount_setattr(target, _RO)


def _symlink(path: str, target: str) -> None:
    """`path` -> `target` in the view, unless a component of `path` is already a symlink or
    a bind there (then `path` resolves through it, or is the host's own)."""
    parts = path.strip("/").split("/")
    current = VIEW_MOUNT
    for part in parts[:-1]:
        current = os.path.join(current, part)
        if os.path.islink(current) or os.path.ismount(current):
            return
    if os.path.lexists(_in_view(path)):
        return
    try:
        os.makedirs(os.path.dirname(_in_view(path)), exist_ok=True)
        os.symlink(target, _in_view(path))
    except OSError:
        pass


def _mount_proc() -> bool:
    os.makedirs(_in_view("/proc"))
    flags = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
    for options in ("subset=pid", ""):
        try:
            linux.mount("proc", _in_view("/proc"), "proc", flags, options)
        except OSError:
            continue
        return True
    return False


def policy(view: bool, work: str, read_paths: list[str], exec_files: list[str]) -> dict:
    """What Landlock and the audit hook allow, as paths the program sees.

    In the view: its own /etc, /proc, /tmp and /dev/shm besides the read paths; without it
    (a weaker machine), the host paths given.
    """
    if view:
        return {
            "read": [*read_paths, "/etc", "/proc", EXEC_DIR, *DEVICES],
            "write": [*PRIVATE_TMPFS, "/dev/null"],
            "work": WORK,
        }
    return {
        "read": [*read_paths, *exec_files, *DEVICES],
        "write": [work, "/dev/null"],
        "work": work,
    }
