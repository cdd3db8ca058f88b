"""Processes of a sandbox run, seen from the host (for tests/agent's sandbox tests)."""

import os
import time


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session `sid` (from /proc; no psutil)."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[3]) == sid:
            members.append(int(entry))
    return members


def assert_session_empty(sid: int) -> None:
    """No process of session `sid` (a run's boot pid) survives (checked for up to 2 s)."""
    deadline = time.monotonic() + 2
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_members(sid) == []
