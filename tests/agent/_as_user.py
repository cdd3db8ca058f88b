"""Run the sandbox, or a program unconfined, as an ordinary user: the red team's second caller.

    python _as_user.py UID confined|unconfined REQUEST_JSON      (started as root)

Enters a private mount namespace in which uid UID can reach the interpreter and the sandbox's
files (a 0700 ancestor, such as /root holding pyenv or CI's `mktemp -d` holding the venv, is
covered by a tmpfs into which only those paths are bound back), drops to UID (no supplementary
groups), then either runs `run_python(code, **kwargs)` and prints its result as one JSON line
(or the refusal's), or runs the code unconfined (`python -I -c code`) and prints its output.
The sandbox package is loaded from its folder without importing jaxrl (which would start JAX).
"""

import json
import os
import stat
import subprocess
import sys
import types

SANDBOX_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "jaxrl", "agent", "sandbox",
)  # fmt: skip


def load_sandbox():
    package = types.ModuleType("sandbox")
    package.__path__ = [SANDBOX_DIR]
    sys.modules["sandbox"] = package
    from sandbox import host, layers, linux

    return host, layers, linux


def expose_interpreter(host, linux) -> None:
    """Private mounts in which uid UID can reach the interpreter and the sandbox's files.

    Each path it needs whose ancestor other users cannot traverse (a 0700 /root holding
    pyenv, CI's `mktemp -d` holding the venv) gets that ancestor covered by a tmpfs (0755)
    into which the path is bound back, at the same place.
    """
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    covers: dict[str, list[str]] = {}
    for path in sorted({*host.default_read_paths(), SANDBOX_DIR}):
        closed = next((a for a in ancestors(path) if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if closed is not None:
            covers.setdefault(closed, []).append(path)
    for closed, paths in covers.items():
        fds = {path: os.open(path, os.O_PATH) for path in paths}
        linux.mount("tmpfs", closed, "tmpfs", linux.MS_NOSUID, "mode=0755")
        for path, fd in fds.items():
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "a").close()
            linux.mount(f"/proc/self/fd/{fd}", path, None, linux.MS_BIND | linux.MS_REC)
            os.close(fd)


def ancestors(path: str) -> list[str]:
    """/a, /a/b, ... of /a/b/c (not / and not the path itself), outermost first."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def main(uid: int, mode: str, request: dict) -> None:
    host, layers, linux = load_sandbox()
    expose_interpreter(host, linux)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.chdir("/tmp")
    if mode == "unconfined":
        done = subprocess.run(
            [sys.executable, "-I", "-c", request["code"]], capture_output=True, text=True,
            timeout=request.get("timeout", 30), pass_fds=request.get("pass_fds", ()),
            cwd=request.get("cwd"),
        )  # fmt: skip
        print(
            json.dumps({"stdout": done.stdout, "stderr": done.stderr, "exit_code": done.returncode})
        )
        return
    try:
        result = host.run_python(request["code"], **request.get("kwargs", {}))
    except layers.SandboxUnavailable as exc:
        print(json.dumps({"refused": exc.missing, "message": str(exc)}))
        return
    fields = ("stdout", "stderr", "exit_code", "signal", "timed_out", "killed_reason",
              "exception", "isolation", "error", "pid")  # fmt: skip
    print(json.dumps({name: getattr(result, name) for name in fields}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
