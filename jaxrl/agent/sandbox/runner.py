"""The runner after its exec: `python -I -B runner.py CONFIG_JSON` runs the program.

A standalone script (the standard library only): inside the file-system view it is the only
file of jaxrl the program's interpreter can read (at /.sandbox/runner.py). It installs the
audit hook, then runs the code as `__main__` (file name "<code>"); an uncaught exception
prints its traceback without the runner's frames and exits 1, as `python file.py` would.

The audit hook (`sys.addaudithook`) denies at the Python level what the kernel's layers deny:
writing (open for writing, mkdir, rename, remove, chmod, utime, xattrs, ...) outside the write
paths, reading (open, listdir, scandir) outside the read and write paths, and connect, bind
and send on sockets other than unix ones; paths are resolved (symlinks included) first. It
is a second layer and not a security boundary by itself (PEP 578: ctypes, C extensions and
child interpreters bypass it).
"""

import builtins
import errno
import json
import linecache
import os
import sys
import traceback
import types


def main(config: dict) -> int:
    with open(config["code_path"], encoding="utf-8", errors="surrogatepass") as f:
        code = f.read()
    sys.stdout.reconfigure(line_buffering=True)  # output before a kill is not lost
    sys.argv = ["<code>"]
    sys.path.insert(0, config["work"])
    if config["audit_hook"]:
        install_audit_hook(config["read"], config["write"])
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    try:
        exec(compile(code, "<code>", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        hide_frames(exc, __file__)
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def hide_frames(exc: BaseException, filename: str) -> None:
    """Drop this file's frames from the tracebacks of `exc` and the exceptions chained to
    it, so the program sees only its own."""
    stack = [exc]
    seen = set()
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        kept, tb = [], error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename != filename:
                kept.append(tb)
            tb = tb.tb_next
        rebuilt = None
        for tb in reversed(kept):
            rebuilt = types.TracebackType(rebuilt, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
        error.__traceback__ = rebuilt
        stack += [error.__cause__, error.__context__]


# Audit events that create, change or remove a path -> (path index, its dir_fd index) pairs.
WRITE_EVENTS = {
    "os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
    "os.truncate": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "os.chflags": ((0, None),), "os.lchflags": ((0, None),), "os.lchmod": ((0, None),),
    "os.lchown": ((0, None),),
}  # fmt: skip
READ_EVENTS = ("os.listdir", "os.scandir")
SOCKET_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
AF_UNIX = 1


def install_audit_hook(read: list, write: list) -> None:
    """Deny file access outside `read`/`write` and non-unix sockets (PermissionError)."""
    writable = tuple(os.path.realpath(p) for p in write)
    readable = (*writable, *(os.path.realpath(p) for p in read))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = bool((flags or 0) & WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            check(path, writable if writing else readable, "writing" if writing else "reading")
        elif event in WRITE_EVENTS:
            for index, fd_index in WRITE_EVENTS[event]:
                dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                check(args[index], writable, "changing", dir_fd)
        elif event in READ_EVENTS:
            check("." if args[0] is None else args[0], readable, "listing")
        elif event in SOCKET_EVENTS and getattr(args[0], "family", AF_UNIX) != AF_UNIX:
            raise PermissionError(errno.EACCES, "Permission denied (sandbox: no network)")

    sys.addaudithook(hook)


def check(path, allowed, action: str, dir_fd=None) -> None:
    """Raise PermissionError unless `path` resolves to one of `allowed` or beneath one."""
    if isinstance(path, int):
        return  # an open file descriptor: its path was checked when it was opened
    name = os.fsdecode(os.fspath(path))
    if not os.path.isabs(name) and dir_fd is not None and dir_fd >= 0:
        try:
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        except OSError:
            name = "/"  # unknown directory: refuse
    resolved = os.path.realpath(name)
    if any(resolved == root or resolved.startswith(root.rstrip("/") + "/") for root in allowed):
        return
    raise PermissionError(
        errno.EACCES,
        f"Permission denied (sandbox: {action} outside the working directory is not allowed)",
        name,
    )


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
