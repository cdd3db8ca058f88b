"""A sandbox for model-written Python (`run_python`), for tools such as `CodeInterpreter`.

    result = run_python("print(2 + 3)", timeout_s=10, cpu_s=10, memory_mb=1024,
                        max_output_bytes=4096)
    result.stdout           # "5\\n"
    result.killed_reason    # None, or why it stopped: "timeout", "cpu_time", "memory", ...
    isolation()             # what this machine applies: {"filesystem_view": True, ...}

Every call runs the code in a fresh interpreter (`sys.executable -I -B`) as an unprivileged
uid, in a file-system view of its own, with a syscall filter, and refuses to run where a
required layer is missing (`SandboxUnavailable`). The files show the layers:

    identity.py  the unprivileged host uid/gid (the user namespace's id maps)
    fsview.py    the mount namespace: a tmpfs root with read-only binds, pivot_root
    seccomp.py   the syscall filter (libseccomp), applied before the exec
    landlock.py  Landlock: a second file-system layer, TCP and scoping
    limits.py    rlimits, nice and the PID namespace's pid_max
    tree.py      the process tree (boot, keeper, init, runner) that applies them
    runner.py    the program's side after the exec: the audit hook, then the code
    host.py      the caller's side: `run_python`, output capture, the backstop kill
    probes.py    `isolation()` and `check()`: what this machine applies
    layers.py    the layers' names, the required ones, how to enable each

docs/sandbox.md says, layer by layer, what is stopped and what is not.
"""

from .host import SandboxResult, default_read_paths, run_python
from .identity import SANDBOX_HOST_ID
from .layers import LAYERS, REQUIRED, SandboxUnavailable
from .probes import check, isolation

__all__ = [
    "LAYERS",
    "REQUIRED",
    "SANDBOX_HOST_ID",
    "SandboxResult",
    "SandboxUnavailable",
    "check",
    "default_read_paths",
    "isolation",
    "run_python",
]
