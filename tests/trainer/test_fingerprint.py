"""Determinism fingerprints: independent of sharding, sensitive to every bit and position;
`python -m jaxrl.compare` finds the first differing step."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.compare import main as compare
from jaxrl.trainer.fingerprint import step_fingerprints, tree_hash


def tree() -> dict:
    rng = np.random.RandomState(0)
    return {
        "w": jnp.asarray(rng.randn(16, 24), jnp.float32),
        "b": jnp.asarray(rng.randn(24), jnp.bfloat16),
        "n": jnp.arange(8, dtype=jnp.int32),
        "m": jnp.array([True, False, True]),
    }


def test_hash_is_independent_of_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    t = tree()
    sharded = dict(t)
    sharded["w"] = jax.device_put(t["w"], NamedSharding(mesh, PartitionSpec("a", "b")))
    sharded["n"] = jax.device_put(t["n"], NamedSharding(mesh, PartitionSpec("b")))
    assert int(tree_hash(t)) == int(tree_hash(sharded))


def test_hash_sees_every_bit_and_position():
    base = int(tree_hash(tree()))
    flipped = tree()
    bits = jax.lax.bitcast_convert_type(flipped["w"], jnp.uint32).at[3, 5].add(1)  # one ulp
    flipped["w"] = jax.lax.bitcast_convert_type(bits, jnp.float32)
    swapped = tree()
    swapped["n"] = swapped["n"][jnp.array([1, 0, 2, 3, 4, 5, 6, 7])]
    renamed = {"a": tree()["w"], **{k: v for k, v in tree().items() if k != "w"}}
    cast = tree()
    cast["b"] = cast["b"].astype(jnp.float32)
    others = [flipped, swapped, renamed, cast]
    hashes = {base, *(int(tree_hash(t)) for t in others)}
    assert len(hashes) == 1 + len(others)


def test_step_fingerprints_are_short_hex():
    batch = {"prompts": jnp.arange(6).reshape(2, 3), "responses": jnp.ones((2, 4), jnp.int32)}
    out = step_fingerprints(batch, {"actor": tree_hash(tree())})
    assert set(out) == {"fingerprint/inputs", "fingerprint/actor"}
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in out.values())
    other = step_fingerprints({**batch, "responses": jnp.zeros((2, 4), jnp.int32)}, {})
    assert other["fingerprint/inputs"] != out["fingerprint/inputs"]


def write_run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rows(actor_at_3="aaaa0003", loss_at_2=0.5):
    return [
        {"training/global_step": 1, "fingerprint/actor": "aaaa0001", "actor/pg_loss": 0.1},
        {"training/global_step": 2, "fingerprint/actor": "aaaa0002", "actor/pg_loss": loss_at_2,
         "timing_s/step": 9.0},
        {"training/global_step": 3, "fingerprint/actor": actor_at_3, "actor/pg_loss": 0.3},
    ]  # fmt: skip


def test_compare_finds_the_first_differing_step(tmp_path, capsys):
    write_run(tmp_path / "a", rows())
    write_run(tmp_path / "b", rows())
    write_run(tmp_path / "c", rows(actor_at_3="bbbb0003", loss_at_2=0.6))
    assert compare([str(tmp_path / "a"), str(tmp_path / "b"), "--metrics"]) == 0
    assert "agree on steps 1-3 (fingerprint/actor and every metric)" in capsys.readouterr().out
    assert compare([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "fingerprint/actor: first differs at step 3" in out
    assert "first difference at step 3: fingerprint/actor = aaaa0003" in out
    assert compare([str(tmp_path / "a"), str(tmp_path / "c"), "--metrics"]) == 1
    assert "step 2: actor/pg_loss = 0.5" in capsys.readouterr().out
    # Nothing compared is not agreement: no inputs fingerprints in these rows.
    assert compare([str(tmp_path / "a"), str(tmp_path / "c"), "--only", "inputs"]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare([str(tmp_path / "a"), str(tmp_path / "c"), "--only", "actr"])
    assert compare([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2


def test_wide_types_hash_every_bit():
    with jax.enable_x64(True):
        x = jnp.arange(4, dtype=jnp.float64)
        hashes = {int(tree_hash({"x": v})) for v in (x, x + 1e-12, x.astype(jnp.int64))}
    assert len(hashes) == 3
