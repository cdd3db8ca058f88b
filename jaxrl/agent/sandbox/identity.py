"""The program's identity: an unprivileged host uid/gid, through the user namespace's id maps.

The namespace maps one id, `INSIDE_ID` (1000, the program's uid and gid inside), to a host id:

    caller    uid_map / gid_map           supplementary groups   the program on the host
    root      1000 -> host_id (default    none (setgroups([]))   host_id: no file, socket or
              SANDBOX_HOST_ID)                                   process of root's is its own
    a user    1000 -> the caller's uid    the caller's (the      the caller (already
              and gid (the only map the   kernel denies          unprivileged; the file-system
              kernel allows a user)       setgroups)             view hides its files)

The maps are written from outside (`write_id_maps`, by the boot process, which keeps the
caller's capabilities in the parent namespace); the init then switches to the inside id
(`become_inside_user`). It keeps its capabilities inside the namespace (the kernel clears them
on a uid change only from the namespace's root, and inside 0 is not mapped), which it needs to
build the file-system view; the runner's `exec` drops them all (a non-root uid execs with none).
"""

from __future__ import annotations

import os

INSIDE_ID = 1000
# No account uses it on ordinary machines: systemd leaves 1879048192-2147483647 unassigned.
SANDBOX_HOST_ID = 2_000_000_000


def host_ids(sandbox_uid: int, sandbox_gid: int) -> tuple[int, int]:
    """The host uid and gid the program runs as: the caller's, unless the caller is root."""
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    if sandbox_uid <= 0 or sandbox_gid <= 0:
        raise ValueError(
            f"sandbox_uid and sandbox_gid must be unprivileged ids (> 0), got "
            f"{sandbox_uid}, {sandbox_gid}"
        )
    return sandbox_uid, sandbox_gid


def write_id_maps(pid: int, uid: int, gid: int) -> None:
    """Map `INSIDE_ID` to host `uid`/`gid` in the user namespace of child `pid`.

    A non-root caller must deny setgroups first (the kernel's rule for unprivileged gid maps).
    """
    if os.getuid() != 0:
        _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"{INSIDE_ID} {uid} 1\n")
    _write(f"/proc/{pid}/gid_map", f"{INSIDE_ID} {gid} 1\n")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def become_inside_user(was_root: bool) -> None:
    """Switch to `INSIDE_ID` (the mapped host id); root's supplementary groups are dropped."""
    if was_root:
        os.setgroups([])
    os.setresgid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    os.setresuid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
