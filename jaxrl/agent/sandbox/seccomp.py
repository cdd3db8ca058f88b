"""The syscall filter: a seccomp-bpf deny list built by libseccomp, applied before the exec.

libseccomp (`libseccomp.so.2`, on every mainstream distribution: Debian's and Ubuntu's
`libseccomp2`, Fedora's `libseccomp`) is called through ctypes rather than a generated BPF
program: it keeps the per-architecture syscall tables, checks the architecture field (a call
through another ABI, e.g. 32-bit `int 0x80` on x86_64, gets EPERM as a whole) and handles
the x32 ABI. Every denied call returns an errno (EPERM; `clone3` ENOSYS, so the C library
falls back to `clone`, whose flags the filter can read); nothing is killed, so the program
sees an ordinary `PermissionError`.

What is denied, and why (`DENIED`): whatever a Python program that computes and prints has
no use for, and that reaches another process, the mount table, namespaces, the kernel's
keyrings, BPF, performance counters, modules, the clock, or a large kernel surface
(io_uring, userfaultfd); memory that no rlimit counts (memfd, System V shared memory and
queues); watching or locking the host files bound into the view (inotify, flock; fcntl's
dnotify and leases). `clone`
may not create namespaces; `prlimit64` may change only the caller's own limits; `socket` may
open only unix, IPv4/IPv6 (in an empty network namespace) and netlink sockets, `socketpair`
only unix ones: in particular not `AF_VSOCK`, which reaches a virtual machine's host and no
network namespace confines.
"""

from __future__ import annotations

import ctypes
import errno
import functools

from . import linux

DENIED = {
    "other processes' memory": (
        "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    ),
    "mounts and namespaces": (
        "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
        "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    ),
    "kernel keyrings": ("keyctl", "add_key", "request_key"),
    "memory no rlimit counts": (
        "memfd_create", "memfd_secret", "shmget", "shmat", "shmdt", "shmctl", "msgget",
        "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open",
        "mq_timedsend",
    ),
    "watching and locking the bound host files": (
        "inotify_init", "inotify_init1", "inotify_add_watch", "flock",
    ),
    "large kernel surfaces": (
        "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "fanotify_mark",
        "io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at",
        "name_to_handle_at", "lookup_dcookie", "uselib", "_sysctl", "modify_ldt",
    ),
    "the machine": (
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
        "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd",
        "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
        "setdomainname", "iopl", "ioperm", "vhangup", "nfsservctl",
    ),
}  # fmt: skip
ENOSYS_CALLS = ("clone3",)  # its flags sit in memory the filter cannot read
# socket(2) domains allowed: AF_UNIX 1, AF_INET 2, AF_INET6 10, AF_NETLINK 16.
ALLOWED_SOCKET_DOMAINS = (1, 2, 10, 16)

_ACT_ALLOW = 0x7FFF0000
_ATTR_ACT_BADARCH = 2
_CMP_NE, _CMP_EQ, _CMP_GE, _CMP_MASKED_EQ = 1, 4, 5, 7
AF_UNIX = 1
F_SETLEASE, F_NOTIFY = 0x400, 0x402


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


@functools.cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_attr_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    )  # fmt: skip
    lib.seccomp_load.argtypes = (ctypes.c_void_p,)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    return lib


def available() -> bool:
    """Whether libseccomp can be loaded (the kernel's support is known only when applied)."""
    return _lib() is not None


def apply() -> None:
    """Load the filter into this process (inherited by every process it starts).

    Needs no_new_privs (set here). Raises OSError when libseccomp is missing or the kernel
    refuses the filter (no CONFIG_SECCOMP_FILTER).
    """
    lib = _lib()
    if lib is None:
        raise OSError(errno.ENOENT, "libseccomp.so.2 not found (install libseccomp2)")
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        _rule_check(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _errno_action(errno.EPERM)))
        for names in DENIED.values():
            for name in names:
                _deny(lib, ctx, name, errno.EPERM)
        for name in ENOSYS_CALLS:
            _deny(lib, ctx, name, errno.ENOSYS)
        for flag in linux.NAMESPACE_FLAGS:  # clone's flags are its first argument
            _deny(lib, ctx, "clone", errno.EPERM, _ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
        # Another process's rlimits (the init's: it shares the program's uid); 0 is itself.
        _deny(lib, ctx, "prlimit64", errno.EPERM, _ArgCmp(0, _CMP_NE, 0, 0))
        _deny(lib, ctx, "socketpair", errno.EAFNOSUPPORT, _ArgCmp(0, _CMP_NE, AF_UNIX, 0))
        for command in (F_SETLEASE, F_NOTIFY):  # leases and dnotify on the bound host files
            _deny(lib, ctx, "fcntl", errno.EPERM, _ArgCmp(1, _CMP_EQ, command, 0))
        for domain in _denied_socket_domains():
            _deny(lib, ctx, "socket", errno.EAFNOSUPPORT, domain)
        linux.no_new_privs()
        _rule_check(lib.seccomp_load(ctx))
    finally:
        lib.seccomp_release(ctx)


def _denied_socket_domains() -> list[_ArgCmp]:
    """Every domain outside `ALLOWED_SOCKET_DOMAINS`: the small ones one by one, then >= 17."""
    top = max(ALLOWED_SOCKET_DOMAINS) + 1
    small = [_ArgCmp(0, _CMP_EQ, d, 0) for d in range(top) if d not in ALLOWED_SOCKET_DOMAINS]
    return [*small, _ArgCmp(0, _CMP_GE, top, 0)]


def _deny(lib: ctypes.CDLL, ctx: int, name: str, code: int, *conditions: _ArgCmp) -> None:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:
        return  # not a syscall on this architecture (or unknown to this libseccomp)
    array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
    _rule_check(
        lib.seccomp_rule_add_array(ctx, _errno_action(code), number, len(conditions), array)
    )


def _rule_check(result: int) -> None:
    if result < 0:
        raise OSError(-result, f"libseccomp: {errno.errorcode.get(-result, -result)}")
