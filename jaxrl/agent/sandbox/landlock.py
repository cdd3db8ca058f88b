"""Landlock (Linux >= 5.13, unprivileged): a second file-system layer, and TCP and scoping.

Every file-system right the kernel's ABI knows is handled (so denied unless a rule grants it
beneath a path): read and execute beneath the read paths, every right beneath the write paths.
TCP bind and connect are handled with no rule (ABI >= 4: denied); signals to, and abstract
unix sockets of, processes outside the sandbox are scoped away (ABI >= 6). Inside the
file-system view the paths are the view's; without it (a weaker machine) the host's.
"""

from __future__ import annotations

import ctypes
import os
import stat

from . import linux

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
FS_DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
NONE = {"landlock_fs": False, "landlock_net": False, "landlock_scope": False}


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (old kernel, or not enabled)."""
    try:
        return linux.syscall(
            SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION),
            name="landlock_create_ruleset",
        )  # fmt: skip
    except OSError:
        return 0


def rules(read: list[str], write: list[str]) -> list[tuple[str, int]]:
    """(path, access) pairs: read beneath `read`, everything beneath a `write` directory,
    reading and writing a `write` file (e.g. /dev/null)."""
    pairs = [(path, FS_READ) for path in read]
    pairs += [(path, -1 if os.path.isdir(path) else FS_DEVICE) for path in write]
    return pairs


def restrict(pairs: list[tuple[str, int]]) -> dict[str, bool]:
    """Restrict this process and all it will start to `pairs`; which parts applied."""
    version = abi()
    if version < 1:
        return dict(NONE)
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    fs |= (FS_REFER if version >= 2 else 0) | (FS_TRUNCATE if version >= 3 else 0)
    fs |= FS_IOCTL_DEV if version >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if version < 4 else 16 if version < 6 else 24  # the struct as this ABI knows it
    ruleset = linux.syscall(
        SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0),
        name="landlock_create_ruleset",
    )  # fmt: skip
    try:
        for path, access in pairs:
            _allow(ruleset, path, fs & access)
        linux.no_new_privs()
        linux.syscall(SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0), name="landlock_restrict_self")
    finally:
        os.close(ruleset)
    return {"landlock_fs": True, "landlock_net": bool(net), "landlock_scope": bool(scoped)}


def _allow(ruleset: int, path: str, access: int) -> None:
    """Grant `access` beneath `path` (only file rights on a file); skip a missing path."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= FS_FILE_RIGHTS
        rule = _PathBeneathAttr(access, fd)
        linux.syscall(
            SYS_ADD_RULE, ruleset, ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule),
            ctypes.c_uint32(0), name="landlock_add_rule",
        )  # fmt: skip
    finally:
        os.close(fd)
