"""One process of a multi-process test: `python worker.py MODE` with JAXRL_* in its environment.

Modes:
    collectives  initialize, check the devices, run a jitted psum and `process_allgather`, and
                 print one JSON line `RESULT {...}`.
    loop         initialize, then run cross-process reductions forever, printing `READY` once.
    raise        as loop, but the last process raises an exception after `READY`.
    init         initialize and exit.
    processes    `jaxrl.sharding.processes` and multi-process `generate` on a tiny model: print
                 one JSON line `RESULT {...}`.
"""

import json
import sys

from jaxrl import distributed


def collectives() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    # Global x = [0, 1, ..., 7]; each process holds the 4 entries of its own devices.
    local = np.arange(jax.device_count(), dtype=np.float32).reshape(jax.process_count(), -1)
    x = jax.make_array_from_process_local_data(sharding, local[jax.process_index()])

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def psum(x_shard):
        return jax.lax.psum(x_shard, "x")

    summed = multihost_utils.process_allgather(psum(x), tiled=True)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    gathered = multihost_utils.process_allgather(np.array([10 * jax.process_index() + 1]))
    info = distributed.process_info()
    row = dict(
        process_id=info.process_id,
        num_processes=info.num_processes,
        process_index=jax.process_index(),
        device_count=jax.device_count(),
        local_device_count=jax.local_device_count(),
        psum=np.asarray(summed).tolist(),
        total=float(total),
        allgather=np.asarray(gathered).tolist(),
        main=distributed.is_main_process(),
        prefix=distributed.process_log_prefix(),
    )
    print("RESULT " + json.dumps(row), flush=True)


def loop(fail: bool = False) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("x")), jnp.ones((jax.local_device_count(),))
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    for step in range(10**9):
        value = float(total(x))  # blocks on the cross-process all-reduce
        if step == 20:
            print(f"READY {value}", flush=True)
        if fail and step == 40 and jax.process_index() == jax.process_count() - 1:
            raise RuntimeError("boom on purpose")


def processes() -> None:
    import jax
    import numpy as np

    import jaxrl.models as M
    from jaxrl.rollout import SamplingParams, generate
    from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh
    from jaxrl.sharding.processes import (
        allgather_objects,
        gather_rows,
        global_array,
        process_rows,
        to_host,
    )
    from jaxrl.testing.tiny import tiny_decoder

    pid = jax.process_index()
    # process p holds p + 1 rows whose values say where they came from
    rows = gather_rows(
        {
            "x": np.full((pid + 1, 2), pid, np.int32),
            "y": np.arange(pid + 1.0),  # float64
            "z": np.full((pid + 1,), 2**40 + pid, np.int64),
        }
    )
    keys_error = ""
    try:
        gather_rows({"a": np.zeros(1)} if pid == 0 else {"b": np.zeros(1)})
    except ValueError as e:
        keys_error = str(e)
    objects = allgather_objects({"pid": pid, "words": ["a"] * pid})
    layout = Layout.create(rollout_mesh(1), ROLLOUT_RULES)
    host = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    sharding = layout.tokens((8, 3))
    x = global_array(host, sharding)
    doubled = to_host(jax.jit(lambda a: 2 * a)(x))
    host_values = [float(to_host(np.float32(3))), list(to_host(x[0]).shape)]
    shape_error = ""
    try:
        gather_rows({"x": np.zeros((1, pid + 1))})
    except ValueError as e:
        shape_error = str(e)
    config = tiny_decoder()
    params = M.init_params(config, jax.random.key(0), std=0.5)
    params = jax.device_put(params, M.param_shardings(config, layout))
    rng = np.random.RandomState(pid)
    ids = rng.randint(2, config.vocab_size, (4, 5))
    greedy = SamplingParams(max_tokens=4, n=2, do_sample=False, temperature=0.0)
    out = generate(config, params, ids, np.ones_like(ids), greedy, layout=layout)
    # 3 prompts x n=2 = 6 rows per process, padded to 8 (a multiple of its 4 dp devices),
    # 4 slots: rows are queued across processes and slots refilled
    padded = generate(
        config, params, ids[:3], np.ones_like(ids[:3]), greedy, layout=layout, max_num_seqs=4
    )
    count_error = ""
    try:
        few = ids[: pid + 1]
        generate(config, params, few, np.ones_like(few), greedy, layout=layout)
    except ValueError as e:
        count_error = str(e)
    local = _local_engine(config, params, ids)
    placed = _placed_engine(config, params, ids, greedy)
    row = dict(
        **local,
        placed_responses=placed,
        **_moves(),
        one_process=_one_process_arrays(),
        rows_x=rows["x"].tolist(),
        rows_y=rows["y"].tolist(),
        rows_y_dtype=str(rows["y"].dtype),
        rows_z=rows["z"].tolist(),
        host_values=host_values,
        keys_error=keys_error,
        padded_responses=np.asarray(padded.responses).tolist(),
        objects=objects,
        doubled_ok=bool((doubled == 2 * host).all()),
        process_rows=list(process_rows(sharding, (8, 3))),
        shape_error=shape_error,
        prompts=ids.tolist(),
        responses=np.asarray(out.responses).tolist(),
        count_error=count_error,
    )
    print("RESULT " + json.dumps(row), flush=True)


def _local_engine(config, params, ids) -> dict:
    """Each process's share of a rollout engine over both (`RolloutEngine.local`): its mesh,
    slots, greedy rows through its own slots, a reload seen by its view, and the refusals
    (a `tp` group spanning processes, a view of an array split over `dp`, conversations on
    the spanning engine)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl.rollout import RolloutEngine, SamplingParams, Scheduler
    from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh
    from jaxrl.sharding.processes import local_mesh, local_view, row_span

    layout = Layout.create(rollout_mesh(2), ROLLOUT_RULES)  # dp 4 (2 per process) x tp 2
    engine = RolloutEngine(config, layout, max_num_seqs=8, max_model_len=32)
    engine.load_weights(params, version=1)
    local = engine.local()
    greedy = SamplingParams(max_tokens=4, n=2, do_sample=False, temperature=0.0)
    mask, key = np.ones_like(ids), jax.random.key(0)
    first = Scheduler(local).generate(ids, mask, greedy, key, fast=False)
    engine.load_weights(params, version=2)  # a new copy: the share views it
    again = Scheduler(engine.local()).generate(ids, mask, greedy, key, fast=False)
    errors = {}
    try:
        Scheduler(engine).generate(ids, mask, greedy, key, fast=False)
    except ValueError as e:
        errors["spanning"] = str(e)
    try:
        local_mesh(rollout_mesh(8))  # one tp group over both processes
    except ValueError as e:
        errors["tp"] = str(e)
    split = jax.device_put(np.zeros((8, 2), np.float32), NamedSharding(layout.mesh, P("dp")))
    try:
        local_view(split, local.layout.mesh)
    except ValueError as e:
        errors["split"] = str(e)
    engine.release()
    return dict(
        local_devices=sorted(d.process_index for d in local.layout.mesh.devices.flat),
        local_shape=dict(local.layout.mesh.shape),
        local_slots=local.slots,
        local_version=[first.version, again.version],
        local_responses=np.asarray(first.responses).tolist(),
        local_again=np.asarray(again.responses).tolist(),
        local_released=local.params is None,
        span=list(row_span(jax.process_index() + 1)),
        local_errors=errors,
    )


def _placed_engine(config, params, ids, greedy) -> list:
    """An engine on process 1's 4 devices only that both processes generate on
    (`every_process=True`): its weights pushed from the 8 devices to process 1's, process
    0's prompts and rows crossing device to device. This process's greedy responses."""
    import jax
    import numpy as np

    from jaxrl.rollout import RolloutEngine
    from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh

    theirs = [d for d in jax.devices() if d.process_index == 1]
    layout = Layout.create(rollout_mesh(1, theirs), ROLLOUT_RULES)
    engine = RolloutEngine(config, layout, every_process=True)
    engine.load_weights(params)
    out = engine.generate(ids, np.ones_like(ids), greedy, jax.random.key(0))
    return np.asarray(out.responses).tolist()


def _moves() -> dict:
    """`reshard.moved` between the processes' device groups (process 0: devices 0-3, process
    1: 4-7), device to device (no host transfer allowed), and a batch's own rows placed and
    read back by each process (`holds_rows`, `read_rows`): per case, how many target shards
    this process holds and whether each holds the right block."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl.sharding.processes import holds_rows, read_rows
    from jaxrl.sharding.reshard import moved

    devices = jax.devices()
    value = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)  # 40 rows: split 2, 4 or 8

    def sharding(group, spec):
        return NamedSharding(Mesh(np.asarray(group), ("x",)), spec)

    cases = {
        "alike": ((devices[:4], P("x")), (devices[4:], P("x"))),
        "whole": ((devices[:4], P()), (devices[4:], P())),
        "4 to 2": ((devices[:4], P("x")), (devices[4:6], P("x"))),
        "back 2 to 4, whole": ((devices[4:6], P("x")), (devices[:4], P())),
        "onto both": ((devices[4:], P()), (devices, P("x"))),
    }
    out = {}
    for name, (source, target) in cases.items():
        x = jax.make_array_from_callback(
            value.shape, sharding(*source), lambda i: value[i], dtype=value.dtype
        )
        with (
            jax.transfer_guard_device_to_host("disallow"),
            jax.transfer_guard_host_to_device("disallow"),
        ):
            y = moved(x, sharding(*target))
        right = [bool(np.array_equal(np.asarray(s.data), value[s.index])) for s in
                 y.addressable_shards]  # fmt: skip
        out[name] = [len(right), all(right), y.sharding == sharding(*target)]
    rows = sharding(devices, P("x"))
    mine = (20 * jax.process_index(), 20 * jax.process_index() + 20)
    own = jax.make_array_from_process_local_data(rows, value[mine[0] : mine[1]], value.shape)
    return {
        "moves": out,
        "holds_own": holds_rows(rows, value.shape, *mine),
        "holds_other": holds_rows(rows, value.shape, 0, 20),  # process 1 does not
        "read_own": bool(np.array_equal(read_rows(own, *mine), value[mine[0] : mine[1]])),
    }


def _one_process_arrays() -> dict:
    """Arrays on process 0's devices only (a trainer placed there; two device groups, a 0-d
    bfloat16, an empty array): `to_host` gives both processes their values (process 1's
    device to device), and a checkpoint of them and of an array on every process, written
    by both processes (through copies on process 1: orbax refuses an array of one process),
    restores them exactly, in their own shardings."""
    import tempfile

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl.checkpoint import Checkpoints, abstract, verify
    from jaxrl.sharding.processes import allgather_objects, received_bytes, to_host

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("a"))
    state = {
        "w": jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, P("a", "b")), lambda i: value[i], dtype=value.dtype
        ),
        "flags": jax.jit(lambda: np.asarray([True, False, True]), out_shardings=whole)(),
        "step": jax.jit(lambda: np.full(2, 7, np.int32), out_shardings=rows)(),
    }
    pair = NamedSharding(Mesh(np.asarray(jax.devices()[:2]), ("a",)), P())
    others = {
        "scale": jax.jit(lambda: jax.numpy.bfloat16(1.5), out_shardings=pair)(),
        "empty": jax.jit(lambda: np.zeros((0, 3), np.float32), out_shardings=pair)(),
    }
    local_error = ""
    try:
        to_host(jax.numpy.ones(2))  # process-local: each process's own device
    except ValueError as e:
        local_error = str(e)
    before = received_bytes()
    host = to_host({**state, **others})
    read = (np.array_equal(host["w"], value) and host["flags"].tolist() == [True, False, True]
            and host["step"].tolist() == [7, 7] and host["scale"] == 1.5
            and host["scale"].dtype == others["scale"].dtype
            and host["empty"].shape == (0, 3))  # fmt: skip
    received = received_bytes() - before
    directory = allgather_objects(tempfile.mkdtemp(prefix="jaxrl-placed-"))[0]
    ckpts = Checkpoints(directory)
    everywhere = NamedSharding(Mesh(np.asarray(jax.devices()), ("a",)), P())
    three = jax.jit(lambda: np.float32(3), out_shardings=everywhere)()
    state = {**state, "scale": others["scale"], "all": three}  # orbax saves no empty array
    ckpts.save(1, {"state": state}, {"step": 1})
    ckpts.wait()
    restored, meta = ckpts.restore(1, {"state": abstract(state)})
    back = restored["state"]
    same = all(
        b.sharding == s.sharding and np.array_equal(to_host(b), to_host(s))
        for b, s in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True)
    )
    return {
        "read": bool(read),
        "local_error": local_error,
        "received": received,
        "restored": same and meta == {"step": 1},
        "verified": verify(ckpts.step_dir(1)) is None,
    }


if __name__ == "__main__":
    distributed.initialize()
    modes = {"collectives": collectives, "loop": loop, "raise": lambda: loop(fail=True)}
    modes["init"] = lambda: None
    modes["processes"] = processes
    modes[sys.argv[1]]()
