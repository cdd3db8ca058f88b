"""The Linux calls the sandbox's layers are made of, through ctypes (stdlib only).

Namespaces (`unshare`), mounts (`mount`, `mount_setattr`, `pivot_root`, `umount2`) and raw
`syscall`s; each raises OSError with the call's name on failure. The syscall numbers used here
(mount_setattr 442, landlock 444-446) are the same on every architecture (the generic table).
"""

# try/except instead of contextlib.suppress: the sandbox's processes import as little as they
# can (an interpreter start is most of a call's cost).
# ruff: noqa: SIM105

from __future__ import annotations

import ctypes
import functools
import os
import signal

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NAMESPACE_FLAGS = (
    CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
    CLONE_NEWNET, CLONE_NEWTIME,
)  # fmt: skip

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
SYS_MOUNT_SETATTR = 442
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38


@functools.cache
def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


def _check(result: int, call: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{call}: {os.strerror(code)}")
    return result


def syscall(number: int, *args: object, name: str = "syscall") -> int:
    return _check(libc().syscall(ctypes.c_long(number), *args), f"{name} ({number})")


def unshare(flags: int) -> None:
    _check(libc().unshare(flags), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    result = libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(result, f"mount({source!r} on {target!r})")


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def mount_setattr(target: str, attr_set: int, *, recursive: bool = True) -> None:
    """Set mount flags on `target` and (`recursive`) every mount beneath it (Linux >= 5.12)."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    syscall(
        SYS_MOUNT_SETATTR, ctypes.c_int(AT_FDCWD), os.fsencode(target), ctypes.c_uint(flags),
        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), name="mount_setattr",
    )  # fmt: skip


def pivot_into(new_root: str) -> None:
    """Make `new_root` (a mount point) this process's `/` and detach the old root.

    `pivot_root(".", ".")` stacks the old root on the new one; unmounting "." then removes
    the old root from this mount namespace (the trick runc and bubblewrap use).
    """
    os.chdir(new_root)
    _check(libc().syscall(ctypes.c_long(_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(libc().umount2(b".", MNT_DETACH), "umount2(old root)")
    os.chdir("/")


_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(
    os.uname().machine, -1
)


def not_dumpable() -> None:
    """This process's /proc entries become root's: no process of its uid opens its fds,
    memory or environment (the runner's exec makes the program dumpable again)."""
    _check(libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def exited(pid: int) -> bool:
    """Whether child `pid` has exited, leaving it unreaped (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def killpg(pgid: int) -> None:
    """SIGKILL process group `pgid`, if it is still there and ours to signal."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def no_new_privs() -> None:
    """No exec from here on gains privileges (setuid bits, file capabilities)."""
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
