"""Checkpoint folders damaged on disk, a full disk, retention: `Checkpoints` finds every broken
step before loading it, falls back to the newest intact one, and refuses when there is none.

Each damage is done to real orbax checkpoints of a small state; the end-to-end runs (a real
training run resumed over the damage) are in `test_training_faults.py`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _damage import flip_bytes
from _env import subprocess_env

from jaxrl.checkpoint import (
    KILLED,
    MANIFEST,
    CheckpointError,
    Checkpoints,
    abstract,
    saving_marker,
    verify,
)

pytestmark = pytest.mark.faults


def state(step: int) -> dict:
    return {"actor": {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(8.0) + step}}


def saved(folder: Path, steps=(1, 2, 3), max_to_keep=None) -> Checkpoints:
    ckpts = Checkpoints(folder, max_to_keep=max_to_keep)
    for step in steps:
        ckpts.save(step, state(step), {"global_step": step})
    ckpts.wait()
    return ckpts


def largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete(path: Path) -> None:
    path.unlink()


def break_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST).write_text('{"files": ')


DAMAGES = {
    "flipped-bytes": lambda d: flip_bytes(largest_file(d)),
    "truncated-file": lambda d: truncate(largest_file(d)),
    "deleted-file": lambda d: delete(largest_file(d)),
    "metadata-rewritten": lambda d: (d / "_CHECKPOINT_METADATA").write_text("{}"),
    "broken-manifest": break_manifest,
}


@pytest.mark.fault(
    fault=(
        "The newest checkpoint damaged on disk: bytes flipped, a file truncated or deleted, "
        "metadata rewritten, its checksum manifest broken"
    ),
    outcome=(
        "Resume checks every file's size and sha256 against the manifest written at the save's "
        "commit, names the broken step, moves it to `checkpoints.set_aside/` and resumes from the"
        " previous intact step"
    ),
    lost="The steps since that previous checkpoint",
)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_newest_falls_back_to_previous(tmp_path, damage, caplog):
    ckpts = saved(tmp_path / "ckpt")
    DAMAGES[damage](ckpts.step_dir(3))
    with pytest.raises(CheckpointError, match=r"ckpt/3 cannot be trusted: .*resume_from_path"):
        ckpts.restore(3, {"actor": abstract(state(3)["actor"])})
    with caplog.at_level(logging.WARNING, logger="jaxrl.train"):
        assert ckpts.restorable_step() == 2
    assert "ckpt/3" in caplog.text and "resuming from step 2" in caplog.text
    assert ckpts.all_steps() == [1, 2]
    (aside,) = ckpts.set_aside_dir.iterdir()  # kept for inspection, never deleted
    assert aside.name.startswith("3.broken.")
    restored, meta = ckpts.restore(2, {"actor": abstract(state(2)["actor"])})
    np.testing.assert_array_equal(restored["actor"]["w"], state(2)["actor"]["w"])
    assert meta == {"global_step": 2}
    ckpts.close()


@pytest.mark.fault(
    fault="A save killed after orbax's rename but before jaxrl's commit (no manifest)",
    outcome="The step is treated as unfinished: deleted, and the previous intact step is resumed",
    lost="The steps since that previous checkpoint",
)
def test_unfinished_save_is_deleted_not_trusted(tmp_path):
    """A step folder without a manifest: orbax finished, the commit did not (killed)."""
    ckpts = saved(tmp_path)
    (ckpts.step_dir(3) / MANIFEST).unlink()
    assert verify(ckpts.step_dir(3)) == "no checksum manifest: its save did not complete"
    assert ckpts.restorable_step() == 2
    assert ckpts.all_steps() == [1, 2] and not ckpts.set_aside_dir.exists()
    ckpts.close()


@pytest.mark.fault(
    fault="The run killed inside its first save, after orbax's rename, before jaxrl's commit",
    outcome="The marked, unfinished step is deleted and the run starts over at step 1",
    lost="The steps before that save",
)
def test_killed_first_save_starts_over(tmp_path, caplog):
    """Only the in-flight marker tells a killed save from a step that predates checksums: the
    first is deleted (the run starts over), the second refuses (see the test below)."""
    ckpts = saved(tmp_path, steps=(1,))
    assert not list(tmp_path.glob("*.jaxrl-saving"))  # the commit removed the marker
    lone = Checkpoints(tmp_path / "legacy")  # no manifest, no marker: older than checksums
    (tmp_path / "legacy" / "1").mkdir()
    with pytest.raises(CheckpointError, match="seal it with"):
        lone.restorable_step()
    assert lone.all_steps() == [1]  # refused, never deleted
    lone.close()
    (ckpts.step_dir(1) / MANIFEST).unlink()
    saving_marker(ckpts.step_dir(1)).write_text("0\n")  # as a kill before the commit leaves
    saving_marker(ckpts.step_dir(7)).write_text("0\n")  # killed before orbax's rename
    assert verify(ckpts.step_dir(1)) == KILLED
    with caplog.at_level(logging.WARNING, logger="jaxrl.train"):
        assert ckpts.restorable_step() is None
    assert "deleted it, starting over" in caplog.text
    assert ckpts.all_steps() == [] and not list(tmp_path.glob("*.jaxrl-saving"))
    ckpts.save(1, state(1), {"global_step": 1})  # the run's first save again
    ckpts.wait()
    saving_marker(ckpts.step_dir(1)).write_text("0\n")  # killed after the commit: stale
    assert ckpts.restorable_step() == 1
    assert not list(tmp_path.glob("*.jaxrl-saving"))  # removed when the step was chosen
    ckpts.close()


@pytest.mark.fault(
    fault="Every checkpoint of the run broken or unfinished",
    outcome=(
        "Resume refuses with the folder, each step's problem and the two ways out; nothing is "
        "loaded, moved or deleted"
    ),
    lost="Nothing (the run does not start)",
)
def test_no_intact_checkpoint_refuses_and_changes_nothing(tmp_path):
    ckpts = saved(tmp_path / "ckpt", steps=(1, 2))
    flip_bytes(largest_file(ckpts.step_dir(2)))
    (ckpts.step_dir(1) / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as err:
        ckpts.restorable_step()
    message = str(err.value)
    assert f"no intact checkpoint in {tmp_path / 'ckpt'}" in message
    assert "step 2: " in message and "sha256 mismatch" in message
    assert "step 1: no checksum manifest" in message
    assert "trainer.resume_from_path" in message and "move those folders away" in message
    assert ckpts.all_steps() == [1, 2]  # nothing deleted or moved
    ckpts.close()


def test_empty_folder_has_no_restorable_step(tmp_path):
    ckpts = Checkpoints(tmp_path)
    assert ckpts.restorable_step() is None
    ckpts.close()


@pytest.mark.fault(
    fault="`max_actor_ckpt_to_keep` retention at any moment of a save",
    outcome="Older steps are deleted only after the newer one is committed",
    lost="Nothing: a committed checkpoint always exists once one was written",
)
def test_retention_deletes_only_after_the_newer_commit(tmp_path):
    ckpts = saved(tmp_path, steps=(1, 2, 3, 4), max_to_keep=2)
    assert ckpts.all_steps() == [3, 4]
    assert all(verify(ckpts.step_dir(s)) is None for s in (3, 4))
    ckpts.close()
    ckpts = saved(tmp_path / "one", steps=(1, 2), max_to_keep=1)
    assert ckpts.all_steps() == [2]
    ckpts.close()


@pytest.mark.fault(
    fault=(
        "A run resumed from an earlier step reaches the step of an existing (e.g. corrupt) folder"
    ),
    outcome=(
        "The old folder is moved to `checkpoints.set_aside/`, the new step is written in its place"
    ),
    lost="Nothing (the old folder is kept aside)",
)
def test_resuming_an_earlier_step_sets_later_ones_aside(tmp_path):
    ckpts = saved(tmp_path / "ckpt")
    ckpts.set_aside_after(1)
    assert ckpts.all_steps() == [1]
    assert sorted(p.name.split(".")[:2] for p in ckpts.set_aside_dir.iterdir()) == [
        ["2", "replaced"],
        ["3", "replaced"],
    ]
    ckpts.save(2, state(20), {"global_step": 2})  # a new step 2, not the old one
    ckpts.wait()
    restored, _ = ckpts.restore(2, {"actor": abstract(state(2)["actor"])})
    assert float(restored["actor"]["w"][0, 0]) == 20.0
    ckpts.close()


DISK_FULL = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp
    from jaxrl.checkpoint import Checkpoints, CheckpointError
    c = Checkpoints(sys.argv[1])
    c.save(1, {"actor": {"w": jnp.ones((64, 64))}}, {"global_step": 1})
    c.wait()
    noise = jax.random.normal(jax.random.key(0), (1024, 1024))  # 4 MiB, incompressible
    c.save(2, {"actor": {"w": noise}}, {"global_step": 2})
    try:
        c.wait()
    except CheckpointError as e:
        print("ERROR:", e)
    else:
        sys.exit(1)
    c.close()  # the failure was reported: closing raises nothing more (orbax would re-raise)
    c = Checkpoints(sys.argv[1])
    c.save(3, {"actor": {"w": noise}}, {"global_step": 3})
    try:
        c.close()  # a failure first seen by close is raised by it, as a CheckpointError
    except CheckpointError as e:
        print("CLOSE:", str(e).split(":")[0])
        sys.exit(3)
    """
)


@pytest.mark.fault(
    fault="Disk full during a checkpoint write (a 2 MiB tmpfs)",
    outcome=(
        "The run stops with an error naming the step, the folder, the intact previous step and "
        "the fix; that step stays restorable"
    ),
    lost="The steps since the previous checkpoint",
)
def test_disk_full_stops_with_a_clear_error_and_keeps_the_previous(tmp_path):
    """A 2 MiB tmpfs in a private mount namespace (no mount outside this test)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL)
    env = subprocess_env()
    inner = f"mount -t tmpfs -o size=2m tmpfs {mount} && {sys.executable} {script} {mount}/ckpt"
    inner += f" ; code=$? ; cp -r {mount}/ckpt {tmp_path}/copy ; exit $code"
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", inner], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert "the checkpoint of step 2 could not be written" in out.stdout
    assert "No space left on device" in out.stdout
    assert "Step 1 is intact" in out.stdout and "trainer.resume_from_path=" in out.stdout
    assert "CLOSE: the checkpoint of step 3 could not be written" in out.stdout
    copy = Checkpoints(tmp_path / "copy")
    assert copy.restorable_step() == 1
    restored, _ = copy.restore(1, {"actor": abstract({"w": jnp.zeros((64, 64))})})
    np.testing.assert_array_equal(restored["actor"]["w"], np.ones((64, 64)))
    copy.close()


def test_seal_and_verify_by_hand(tmp_path, capsys):
    """`python -m jaxrl.checkpoint`: a step without a manifest (written before jaxrl
    kept checksums) is sealed once, then verifies; a damaged step fails verification."""
    from jaxrl.checkpoint import main

    ckpts = saved(tmp_path / "ckpt", steps=(1, 2))
    ckpts.close()
    (ckpts.step_dir(1) / MANIFEST).unlink()
    assert main(["verify", str(ckpts.step_dir(1))]) == 1
    assert "no checksum manifest" in capsys.readouterr().err
    assert main(["seal", str(ckpts.step_dir(1))]) == 0
    assert main(["seal", str(ckpts.step_dir(1))]) == 1  # once only
    assert "has a checksum manifest already" in capsys.readouterr().err
    flip_bytes(largest_file(ckpts.step_dir(2)))
    assert main(["verify", str(ckpts.step_dir(1)), str(ckpts.step_dir(2))]) == 1
    out = capsys.readouterr()
    assert f"{ckpts.step_dir(1)}: intact" in out.out and "sha256 mismatch" in out.err
    assert main(["seal", str(tmp_path)]) == 1
    assert verify(tmp_path / "ckpt" / "9") == "no such step folder"
