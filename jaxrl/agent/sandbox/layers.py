"""The sandbox's layers: their names, the ones required by default, and how to get each.

A run reports which layers it applied (`SandboxResult.isolation`, keys `LAYERS`). A caller
states the layers it requires (`REQUIRED` by default); when the machine refuses one, the
runner does not exec the program and `run_python` raises `SandboxUnavailable`, naming the
layer and the kernel setting it needs, unless weaker isolation is allowed.
"""

from __future__ import annotations

LAYERS = (
    "user_namespace", "unprivileged_identity", "filesystem_view", "network_namespace",
    "pid_namespace", "ipc_namespace", "pid_limit", "process_limit", "landlock_fs",
    "landlock_net", "landlock_scope", "syscall_filter", "audit_hook",
)  # fmt: skip
# The PID namespace too: without it a program's setsid()'d children outlive the run.
REQUIRED = (
    "unprivileged_identity", "filesystem_view", "network_namespace", "pid_namespace",
    "ipc_namespace", "syscall_filter",
)  # fmt: skip

_USERNS = (
    "unprivileged user namespaces (sysctl user.max_user_namespaces > 0; on Debian kernels "
    "kernel.unprivileged_userns_clone=1; on Ubuntu >= 23.10 "
    "kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp profile that "
    "allows unshare(CLONE_NEWUSER))"
)
NEEDS = {
    "user_namespace": _USERNS,
    "unprivileged_identity": (
        f"a user namespace whose id maps the caller may write: {_USERNS}; as root, "
        "/proc/PID/uid_map and gid_map writable (CAP_SETUID, CAP_SETGID)"
    ),
    "filesystem_view": (
        f"a mount namespace in the user namespace ({_USERNS}), tmpfs, and mount_setattr "
        "(Linux >= 5.12)"
    ),
    "network_namespace": f"CONFIG_NET_NS and {_USERNS} (or running as root)",
    "pid_namespace": f"CONFIG_PID_NS and {_USERNS} (or running as root)",
    "ipc_namespace": f"CONFIG_IPC_NS and {_USERNS} (or running as root)",
    "pid_limit": f"Linux >= 6.14 (a per-namespace pid_max) and {_USERNS}",
    "process_limit": f"{_USERNS} (RLIMIT_NPROC is not enforced for the host's root)",
    "landlock_fs": "Linux >= 5.13 with Landlock in the LSM list (boot parameter lsm=...,landlock)",
    "landlock_net": "Landlock ABI >= 4 (Linux >= 6.7)",
    "landlock_scope": "Landlock ABI >= 6 (Linux >= 6.12)",
    "syscall_filter": (
        "seccomp filters (CONFIG_SECCOMP_FILTER) and libseccomp (libseccomp.so.2: Debian and "
        "Ubuntu package libseccomp2, Fedora libseccomp)"
    ),
    "audit_hook": "nothing (always applied unless turned off)",
}


class SandboxUnavailable(RuntimeError):
    """A required layer is missing on this machine; the program was not run.

    Attributes:
        missing: The layers (names in `LAYERS`) this machine refused.
    """

    def __init__(self, missing: list[str], detail: str = ""):
        self.missing = list(missing)
        lines = [f"  - {layer}: needs {NEEDS[layer]}" for layer in self.missing]
        super().__init__(
            "the sandbox refuses to run untrusted code: this machine does not provide the "
            f"required isolation layer(s) {', '.join(self.missing)}.\n"
            + "\n".join(lines)
            + ("\n" + detail if detail else "")
            + "\nEnable them (docs/sandbox.md), or accept weaker isolation explicitly: "
            "`allow_weaker_isolation: true` in the tool's config (run_python(..., "
            "allow_weaker_isolation=True))."
        )


def validate(required: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`required` as a tuple, every name checked against `LAYERS`."""
    required = tuple(required)
    unknown = [name for name in required if name not in LAYERS]
    if unknown:
        raise ValueError(f"unknown sandbox layer(s) {unknown}; the layers are {list(LAYERS)}")
    return required
