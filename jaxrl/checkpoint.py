"""Checkpoints of a run with orbax: saved asynchronously, committed with checksums, verified
before they are restored, restored straight into the target shardings.

    ckpt = Checkpoints(run_dir / "checkpoints", max_to_keep=2)
    ckpt.save(step, {"actor": actor_state, "critic": critic_state}, meta)   # returns at once
    step = ckpt.restorable_step()                       # newest intact step (broken ones aside)
    state, meta = ckpt.restore(step, {"actor": abstract_actor, ...})         # ShapeDtypeStructs
                                                                            # with shardings
`meta` is JSON: the global step, the data iterator's state, the KL controller's coefficient,
and what `jaxrl.export` needs (the actor's HF config).

A step is written in two phases, and only a step that went through both is ever restored:

0. process 0 first marks the save as in flight (the file `<dir>/<step>.jaxrl-saving`, removed
   at the commit), so that a step folder without a manifest is known to be a killed save and
   not a step written before jaxrl kept checksums;
1. orbax writes it into a temporary folder and renames that to `<dir>/<step>` when complete
   (a process killed before leaves no step folder);
2. a background thread then hashes every file of the step (sha256) and writes the manifest
   `<dir>/<step>/jaxrl_checksums.json` atomically (temporary file + rename): the commit.

`restore` first checks every file against the manifest (present, same size, same sha256), so
truncated, deleted or flipped bytes are found before anything is loaded (orbax's own reads
check neither: flipped bytes in an array file load silently). `restorable_step` walks the steps
from the newest: a step without a manifest (a save killed before its commit) is deleted, a
step that fails its checksums is moved to `<dir>.set_aside/`, each named in a warning, and the
newest intact step is returned. When every step is a killed save (a run killed in its first
save), they are deleted and the run starts over; when steps exist but none is intact
otherwise, it raises and changes nothing. Retention (`max_to_keep`) deletes older steps only
once a newer one is committed, so a kill at any moment leaves a committed checkpoint once one
exists. A failed write (a full disk) is raised on the training thread by `raise_if_failed` /
`save` / `wait` / `close`, naming the step, the folder and the fix; the previous checkpoint is
untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.sharding.processes import allgather_objects
from jaxrl.sharding.reshard import onto_copies, same_buffers, spanning

log = logging.getLogger("jaxrl.train")

MANIFEST = "jaxrl_checksums.json"
INCOMPLETE = "no checksum manifest: its save did not complete"
KILLED = "no checksum manifest: its save was killed before it committed"
SAVING = ".jaxrl-saving"  # `<dir>/<step>.jaxrl-saving`: the save of <step> is in flight
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or trusted; the message names the folder,
    what is wrong and the fix."""


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with the current shardings) of a tree of arrays: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _spanned(tree: Any) -> Any:
    """`tree` (arrays or restore targets) with each leaf on some processes' devices only
    (a role placed there) on `reshard.spanning` copies that reach every process: orbax
    writes and reads only arrays that span the processes of a multi-process run."""

    def span(x: Any) -> Any:
        wide = spanning(x.sharding) if _placed(x) else None
        if wide is None:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=wide)
        return onto_copies(x, wide)

    return jax.tree.map(span, tree)


def _unspanned(tree: Any, targets: Any) -> Any:
    """Restored `tree` back in its targets' shardings: copy 0's buffers (no transfer)."""

    def back(x: Any, target: Any) -> Any:
        moved = _placed(target) and x.sharding != target.sharding
        return same_buffers(x, target.sharding) if moved else x

    return jax.tree.map(back, tree, targets)


def _placed(x: Any) -> bool:
    """Whether `x` is an array (or a target) in a NamedSharding, in a multi-process run."""
    sharding = getattr(x, "sharding", None)
    return jax.process_count() > 1 and isinstance(sharding, jax.sharding.NamedSharding)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
    """Hash every file of a finished step folder into its manifest (the commit)."""
    files = {
        str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(step_dir)
    }
    tmp = step_dir / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def verify(step_dir: Path) -> str | None:
    """What is wrong with a step folder against its manifest, or None when it is intact."""
    if not step_dir.is_dir():
        return "no such step folder"
    try:
        return _verify_files(step_dir)
    except OSError as e:  # unreadable, or changed while being read: not to be trusted
        return f"a file could not be read ({type(e).__name__}: {e})"


def saving_marker(step_dir: Path) -> Path:
    """The file that marks the save of `step_dir` in flight until its commit."""
    return step_dir.parent / f"{step_dir.name}{SAVING}"


def _verify_files(step_dir: Path) -> str | None:
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return KILLED if saving_marker(step_dir).is_file() else INCOMPLETE
    try:
        files = {
            name: (int(entry["bytes"]), str(entry["sha256"]))
            for name, entry in json.loads(manifest.read_text())["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its checksum manifest {manifest} is unreadable ({type(e).__name__}: {e})"
    for name, (expected_bytes, expected_sha) in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected_bytes:
            return f"{name} has {size} bytes where {expected_bytes} were written"
        if _sha256(path) != expected_sha:
            return f"{name} differs from what was written (sha256 mismatch)"
    return None


def step_numbers(directory: Path) -> list[int]:
    """The steps of a checkpoint folder (its numbered subfolders, committed or not), ascending."""
    if not directory.is_dir():
        return []
    names = (p.name for p in directory.iterdir() if p.is_dir())
    return sorted(int(n) for n in names if n.isdigit())


def survey(directory: str | Path) -> dict[int, str | None]:
    """The steps of a checkpoint folder, newest first, down to the newest intact one (the
    step a run resumes from), and what is wrong with each (None: intact); older steps are not
    read. Reads only (`python -m jaxrl.doctor`)."""
    found: dict[int, str | None] = {}
    for step in reversed(step_numbers(Path(directory).expanduser())):
        found[step] = verify(Path(directory).expanduser() / str(step))
        if found[step] is None:
            break
    return found


class Checkpoints:
    """A folder of step checkpoints (`<dir>/<step>/{state items, meta, manifest}`)."""

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = None):
        self.directory = Path(directory).expanduser().absolute()
        self.max_to_keep = max_to_keep
        # Retention is ours: orbax would delete old steps before the new one is committed.
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._commit_thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._verified: set[int] = set()
        self._failed = False  # a write failure was raised: orbax may raise it again

    @property
    def set_aside_dir(self) -> Path:
        return self.directory.parent / f"{self.directory.name}.set_aside"

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def all_steps(self) -> list[int]:
        """Every step folder (committed or not), ascending."""
        return step_numbers(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start saving `state` (pytrees of arrays) and `meta` (JSON) as `step`; returns
        before the write completes (`wait` blocks until it is committed).

        Raises:
            CheckpointError: `step` exists already (a run resumed from an earlier step calls
                `set_aside_after` first), or the previous save failed.
        """
        self.wait()
        if self.step_dir(step).exists():
            raise CheckpointError(
                f"{self.step_dir(step)} exists already; move it away (set_aside_after) first"
            )
        items = {name: ocp.args.StandardSave(_spanned(tree)) for name, tree in state.items()}
        try:
            if jax.process_index() == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                saving_marker(self.step_dir(step)).write_text(f"{time.time()}\n")
            self._manager.save(
                step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items), force=True
            )
        except OSError as e:
            raise CheckpointError(self._write_failure(step, e)) from e
        self._commit_thread = threading.Thread(
            target=self._commit, args=(step,), name=f"jaxrl-commit-{step}", daemon=True
        )
        self._commit_thread.start()

    def _commit(self, step: int) -> None:
        try:
            self._manager.wait_until_finished()
            if jax.process_index() == 0:
                write_manifest(self.step_dir(step))
                saving_marker(self.step_dir(step)).unlink(missing_ok=True)
        except BaseException as e:  # re-raised on the training thread
            self._failure = (step, e)
            return
        if jax.process_index() == 0:
            try:
                self._retire(step)
            except OSError as e:  # the new step is committed: an old one merely lingers
                log.warning("checkpoint retention in %s: %s", self.directory, e)

    def _retire(self, newest: int) -> None:
        """Retention: keep the newest `max_to_keep` committed steps; steps older than the
        newest committed one that never committed are leftovers of killed saves."""
        if self.max_to_keep is None:
            return
        older = [s for s in self.all_steps() if s < newest]
        committed = [s for s in older if (self.step_dir(s) / MANIFEST).is_file()]
        kept_before_newest = max(self.max_to_keep - 1, 0)
        keep = set(committed[::-1][:kept_before_newest])
        for step in older:
            if step not in keep:
                self._delete(step)

    def _write_failure(self, step: int, error: BaseException) -> str:
        committed = [
            s for s in self.all_steps() if s != step and (self.step_dir(s) / MANIFEST).is_file()
        ]
        if committed:
            previous = (
                f"Step {committed[-1]} is intact: free space there and run again "
                "(trainer.resume_mode=auto continues from it), or continue on another disk with "
                "trainer.default_local_dir=NEW trainer.resume_mode=resume_path "
                f"trainer.resume_from_path={self.step_dir(committed[-1])}"
            )
        else:
            previous = "No earlier step exists: free space there, or choose another disk"
        return (
            f"the checkpoint of step {step} could not be written to {self.directory}: "
            f"{type(error).__name__}: {error}. {previous}"
        )

    def raise_if_failed(self) -> None:
        """Raise the failure of a finished background write, if any (cheap; call per step)."""
        thread = self._commit_thread
        if thread is not None and not thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is committed; raise `CheckpointError` if it failed."""
        if self._commit_thread is not None:
            self._commit_thread.join()
            self._commit_thread = None
        if self._failure is not None:
            step, error = self._failure
            self._failure = None
            self._failed = True
            raise CheckpointError(self._write_failure(step, error)) from error

    def close(self) -> None:
        """Wait for the pending save, then release orbax; a failed save raises its
        `CheckpointError` (once: orbax's own re-raise of it is dropped)."""
        try:
            self.wait()
        finally:  # orbax re-raises a failure already reported as a CheckpointError: drop it
            with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext():
                self._manager.close()

    # -- choosing and restoring -------------------------------------------------------------

    def restorable_step(self) -> int | None:
        """The newest intact step (None when there is no step at all), decided by process 0
        for every process: newer steps that never committed are deleted, broken ones set aside.

        Raises:
            CheckpointError: steps exist but none is intact (nothing is changed then).
        """
        verdict = None
        if jax.process_index() == 0:
            try:
                verdict = self._choose()
            except Exception as e:  # shared as a refusal: the other processes must not hang
                verdict = f"choosing a checkpoint in {self.directory} failed: {e!r}"
        verdict = allgather_objects(verdict)[0]
        if isinstance(verdict, str):
            raise CheckpointError(verdict)
        self._manager.reload()
        if verdict is not None:
            self._verified.add(verdict)  # by process 0, just now: restore need not hash again
        return verdict

    def set_aside_after(self, step: int) -> None:
        """Move every step folder newer than `step` (a run resumed from an earlier step) to
        `set_aside_dir`, so that the steps it saves next are new folders, on every process."""
        if jax.process_index() == 0:
            for newer in (s for s in self.all_steps() if s > step):
                self._set_aside(newer, "replaced")
        allgather_objects(None)  # a barrier: the folders are gone before anyone saves
        self._manager.reload()

    def _choose(self) -> int | str | None:
        for leftover in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(leftover, ignore_errors=True)  # writes killed before orbax's rename
        for leftover in self.directory.glob("*.jaxrl-deleting"):
            shutil.rmtree(leftover, ignore_errors=True)
        for marker in self.directory.glob(f"*{SAVING}"):
            step_dir = self.directory / marker.name.removesuffix(SAVING)
            if not step_dir.is_dir() or (step_dir / MANIFEST).is_file():  # killed before
                marker.unlink(missing_ok=True)  # orbax's rename, or after the commit
        problems: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            problem = verify(self.step_dir(step))
            if problem is None:
                for bad, why in problems:
                    where = self._dispose(bad, why)
                    log.warning(
                        "checkpoint %s: %s; %s, resuming from step %d",
                        self.step_dir(bad),
                        why,
                        where,
                        step,
                    )
                return step
            problems.append((step, problem))
        if not problems:
            return None
        if all(why == KILLED for _, why in problems):  # killed in the run's first save(s)
            for step, why in problems:
                self._delete(step)
                log.warning(
                    "checkpoint %s: %s; deleted it, starting over", self.step_dir(step), why
                )
            return None
        found = "; ".join(f"step {s}: {why}" for s, why in problems)
        unsealed = [step for step, why in problems if why == INCOMPLETE]
        legacy = (
            " A checkpoint written before jaxrl kept checksums has no manifest either: if you "
            "trust it, seal it with python -m jaxrl.checkpoint seal "
            f"{self.step_dir(unsealed[0])}."
            if unsealed
            else ""
        )
        return (
            f"no intact checkpoint in {self.directory} ({found}); nothing was loaded or changed. "
            "To start the run over, move those folders away (or choose another "
            "trainer.experiment_name); to continue from a checkpoint elsewhere, set "
            "trainer.resume_mode=resume_path trainer.resume_from_path=RUN/checkpoints/STEP."
            + legacy
        )

    def _dispose(self, step: int, problem: str) -> str:
        if problem in (INCOMPLETE, KILLED):
            self._delete(step)
            return "deleted it"
        return f"moved it to {self._set_aside(step, 'broken')}"

    def _set_aside(self, step: int, reason: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.set_aside_dir / f"{step}.{reason}.{stamp}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.step_dir(step), target)
        if reason == "replaced":
            log.warning("step folder %s existed: moved to %s", self.step_dir(step), target)
        return target  # callers reload orbax's step list once they are done

    def _delete(self, step: int) -> None:
        doomed = self.directory / f"{step}.jaxrl-deleting"  # not a step name: never listed
        os.replace(self.step_dir(step), doomed)
        saving_marker(self.step_dir(step)).unlink(missing_ok=True)
        shutil.rmtree(doomed)

    def restore(self, step: int, targets: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """(state, meta) of `step` after checking it against its manifest, each tree laid out
        like its target (see `abstract`)."""
        items = {name: ocp.args.StandardRestore(_spanned(t)) for name, t in targets.items()}
        try:
            out = self._restore(step, meta=ocp.args.JsonRestore(), **items)
        except (ValueError, OSError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {self.step_dir(step)} does not fit this run's state "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); was it "
                "written with another model or trainer configuration?"
            ) from e
        return {name: _unspanned(out[name], t) for name, t in targets.items()}, dict(out["meta"])

    def restore_item(self, step: int, name: str, target: Any) -> Any:
        """One item (e.g. `actor_params`) of a verified step."""
        out = self._restore(step, **{name: ocp.args.StandardRestore(_spanned(target))})[name]
        return _unspanned(out, target)

    def read_meta(self, step: int) -> dict[str, Any]:
        return dict(self._restore(step, meta=ocp.args.JsonRestore())["meta"])

    def _restore(self, step: int, **items: Any) -> Any:
        """orbax's restore of `items` from `step`, after checking the step's manifest."""
        self._check(step)
        return self._manager.restore(step, args=ocp.args.Composite(**items))

    def _check(self, step: int) -> None:
        """Verify `step` once per instance: on process 0, its verdict shared by every process."""
        if step in self._verified:
            return
        problem = verify(self.step_dir(step)) if jax.process_index() == 0 else None
        problem = allgather_objects(problem)[0]
        if problem is None:
            self._verified.add(step)
        else:
            raise CheckpointError(
                f"checkpoint {self.step_dir(step)} cannot be trusted: {problem}. Resume from "
                "an earlier step (trainer.resume_mode=resume_path "
                "trainer.resume_from_path=RUN/checkpoints/STEP) or let trainer.resume_mode=auto "
                "choose the newest intact one"
            )


def seal(step_dir: Path) -> None:
    """Write the manifest of a step folder that orbax finished (one written before jaxrl kept
    checksums): from then on it is verified like any other.

    Raises:
        CheckpointError: not a finished orbax step folder, or it has a manifest already.
    """
    step_dir = Path(step_dir).expanduser().absolute()
    if not step_dir.name.isdigit() or not (step_dir / "_CHECKPOINT_METADATA").is_file():
        raise CheckpointError(
            f"{step_dir}: not a finished checkpoint step folder (RUN/checkpoints/N)"
        )
    if (step_dir / MANIFEST).exists():
        raise CheckpointError(f"{step_dir} has a checksum manifest already: nothing to seal")
    write_manifest(step_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxrl.checkpoint seal|verify STEP_DIR...`."""
    parser = argparse.ArgumentParser(prog="python -m jaxrl.checkpoint")
    parser.add_argument("command", choices=("seal", "verify"))
    parser.add_argument("steps", nargs="+", type=Path, help="step folders: RUN/checkpoints/N")
    args = parser.parse_args(argv)
    failed = False
    for step_dir in args.steps:
        try:
            if args.command == "seal":
                seal(step_dir)
                print(f"sealed {step_dir}")
            else:
                problem = verify(step_dir)
                if problem is not None:
                    raise CheckpointError(f"{step_dir}: {problem}")
                print(f"{step_dir}: intact")
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
