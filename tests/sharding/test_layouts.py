"""Layouts on 8 fake devices: shardings, forward/backward and optimizer steps equal to one device,
train <-> rollout resharding (same devices and disjoint), host offload."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxrl.models as M
from jaxrl.config import load_config
from jaxrl.models.params import param_shardings
from jaxrl.sharding import (
    ROLLOUT_RULES,
    TRAIN_RULES,
    Layout,
    free,
    layouts_from_config,
    moved,
    offload,
    reload,
    reshard,
    reshard_report,
    rollout_mesh,
    train_mesh,
    use_layout,
)
from jaxrl.testing.numerics import STABLE_ADAM_EPS, assert_close_to_scale, assert_updates_close
from jaxrl.trainer import make_optimizer
from jaxrl.trainer.update import UpdateState, apply_gradients, init_state, state_shardings

MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (1, 4, 2, 1), (2, 1, 2, 2)]
CONFIG = M.DecoderConfig(
    model_type="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    qkv_bias=True,
)
B, T = 8, 16


def train_layout(dp, fsdp, tp, sp, devices=None):
    return Layout.create(train_mesh(dict(dp=dp, fsdp=fsdp, tp=tp, sp=sp), devices), TRAIN_RULES)


def rollout_layout(tp, devices=None):
    return Layout.create(rollout_mesh(tp, devices), ROLLOUT_RULES)


@pytest.fixture(scope="module")
def params():
    return M.init_params(CONFIG, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, CONFIG.vocab_size, (B, T))
    mask = (np.arange(T)[None] >= rng.randint(0, 6, (B, 1))).astype(np.int32)  # left padding
    advantages = rng.randn(B).astype(np.float32)
    return {"input_ids": ids, "attention_mask": mask, "advantages": advantages}


def pg_loss(params, batch):
    """A policy-gradient loss: -A * log p(next token), token-mean over real tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    h = M.hidden_states(CONFIG, params, ids, mask)
    lp, _ = M.token_log_probs(CONFIG, params, h[:, :-1], ids[:, 1:])
    weights = mask[:, 1:] * batch["advantages"][:, None]
    return -jnp.sum(lp * weights) / jnp.sum(mask[:, 1:]), {}


def place(layout, params, batch):
    return (
        jax.device_put(params, param_shardings(CONFIG, layout)),
        {
            k: jax.device_put(v, layout.sharding(v.shape, ("batch", "seq")[: v.ndim]))
            for k, v in batch.items()
        },
    )


def assert_rel(a, b):
    """Sharded against one device: the same float32 sums split over up to 8 shards, ~1e-6 of
    the scale apart; 1e-5 of the reference's scale leaves a 10x margin."""
    assert_close_to_scale(a, b, rtol=1e-5)


def make_update_step(loss_fn, optimizer, *, grad_clip=1.0, layout=None, shardings=None):
    """A jitted `(state, batch) -> (state, metrics)` over the package's `apply_gradients`
    (state donated; with a layout, `shard()` constraints apply and the state keeps
    `shardings`): the optimizer step without the Learner's micro-batching."""

    def step(state: UpdateState, batch):
        with use_layout(layout):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        new_state, metrics = apply_gradients(state, grads, optimizer, grad_clip)
        return new_state, {"loss": loss, **aux, **metrics}

    if shardings is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(
        step, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0
    )


def test_parameter_shardings_follow_the_layouts():
    train = param_shardings(CONFIG, train_layout(1, 4, 2, 1))
    rollout = param_shardings(CONFIG, rollout_layout(2))
    assert train["layers"]["attn"]["w_q_dnh"].spec == P(None, "fsdp", "tp", None)
    assert train["layers"]["mlp"]["w_down_fd"].spec == P(None, "tp", "fsdp")
    assert train["embed"]["tokens_vd"].spec == P("tp", "fsdp")
    assert train["final_norm_d"].spec == P("fsdp")
    assert rollout["layers"]["attn"]["w_q_dnh"].spec == P(None, None, "tp", None)
    assert rollout["layers"]["mlp"]["w_gate_df"].spec == P(None, None, "tp")
    assert rollout["final_norm_d"].spec == P(None)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_forward_loss_and_grads_match_one_device(shape, params, batch):
    ref_logits = M.forward(CONFIG, params, batch["input_ids"], batch["attention_mask"])
    ref_loss, ref_grads = jax.value_and_grad(lambda p: pg_loss(p, batch)[0])(params)
    layout = train_layout(*shape)
    p, b = place(layout, params, batch)
    with use_layout(layout):
        logits = jax.jit(M.forward, static_argnums=0)(
            CONFIG, p, b["input_ids"], b["attention_mask"]
        )
        # Gradients produced directly in the parameters' layout (ZeRO-3: a shard per device).
        grad_fn = jax.jit(
            jax.value_and_grad(lambda p, b: pg_loss(p, b)[0]),
            out_shardings=(layout.replicated(), param_shardings(CONFIG, layout)),
        )
        loss, grads = grad_fn(p, b)
    assert_rel(logits, ref_logits)
    assert_rel(loss, ref_loss)
    jax.tree.map(assert_rel, grads, ref_grads)
    g, w = grads["layers"]["attn"]["w_q_dnh"], p["layers"]["attn"]["w_q_dnh"]
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim)


@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (2, 2, 2, 1)], ids=lambda s: "x".join(map(str, s)))
def test_optimizer_steps_match_one_device(shape, params, batch):
    from types import SimpleNamespace

    # Adam at STABLE_ADAM_EPS: a gradient entry at float32 noise level (where the summation
    # order of a sharded reduction shows) cannot move by ~lr (jaxrl.testing.numerics).
    lr = 1e-2
    optim = SimpleNamespace(
        optimizer="AdamW", lr=lr, weight_decay=0.01, betas=(0.9, 0.999), eps=STABLE_ADAM_EPS
    )
    optimizer = make_optimizer(optim, total_steps=10)

    def run(layout):
        p, b = (params, batch) if layout is None else place(layout, params, batch)
        p = jax.tree.map(jnp.copy, p)  # the state is donated
        shardings = None if layout is None else param_shardings(CONFIG, layout)
        state = init_state(p, optimizer, layout, shardings)
        step_shardings = (
            None if layout is None else state_shardings(state, optimizer, layout, shardings)
        )
        step = make_update_step(
            pg_loss, optimizer, grad_clip=1.0, layout=layout, shardings=step_shardings
        )
        for _ in range(2):
            state, metrics = step(state, b)
        return state, metrics

    ref_state, ref_metrics = run(None)
    state, metrics = run(train_layout(*shape))
    assert int(state.step) == 2 and int(metrics["skipped"]) == 0
    assert_rel(metrics["grad_norm"], ref_metrics["grad_norm"])
    assert_updates_close(params, state.params, ref_state.params, lr, steps=2)
    mu = state.opt_state[0].mu
    assert (
        mu["layers"]["attn"]["w_q_dnh"].sharding.spec
        == state.params["layers"]["attn"]["w_q_dnh"].sharding.spec
    )
    assert state.opt_state[0].count.sharding.spec == P()


def test_non_finite_gradient_skips_the_step(params, batch):
    optimizer = make_optimizer({"optimizer": "AdamW", "lr": 1e-2}, total_steps=10)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer, None, None)
    before = jax.tree.map(np.asarray, state.params)
    bad = dict(batch, advantages=np.full(B, np.nan, np.float32))
    state, metrics = make_update_step(pg_loss, optimizer)(state, bad)
    assert int(metrics["skipped"]) == 1 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, state.params, before)


REFACTORINGS = [
    ((1, 8, 1, 1), 2),  # train fsdp=8 -> rollout dp=4, tp=2
    ((1, 4, 2, 1), 4),  # train fsdp=4, tp=2 -> rollout dp=2, tp=4
    ((8, 1, 1, 1), 1),
    ((2, 2, 2, 1), 2),
    ((2, 1, 2, 2), 8),
]


@pytest.mark.parametrize("train_shape, tp", REFACTORINGS, ids=str)
@pytest.mark.parametrize("bucket_bytes", [None, 1 << 40])
def test_reshard_round_trip_same_devices(train_shape, tp, bucket_bytes, params):
    train, rollout = train_layout(*train_shape), rollout_layout(tp)
    p = jax.device_put(params, param_shardings(CONFIG, train))
    targets = param_shardings(CONFIG, rollout)
    with jax.transfer_guard("disallow"):
        rolled = reshard(p, targets, bucket_bytes=bucket_bytes)
        back = reshard(rolled, param_shardings(CONFIG, train), bucket_bytes=bucket_bytes)
    jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(s)), rolled, targets
    )
    jax.tree.map(np.testing.assert_array_equal, back, params)
    jax.tree.map(np.testing.assert_array_equal, rolled, params)
    free(rolled)
    assert all(x.is_deleted() for x in jax.tree.leaves(rolled))


def test_reshard_to_bfloat16_rollout(params):
    train, rollout = train_layout(1, 8, 1, 1), rollout_layout(2)
    p = jax.device_put(params, param_shardings(CONFIG, train))
    with jax.transfer_guard("disallow"):
        rolled = reshard(p, param_shardings(CONFIG, rollout), dtype="bfloat16")
    jax.tree.map(
        lambda r, x: np.testing.assert_array_equal(r, x.astype(jnp.bfloat16)), rolled, params
    )
    assert rolled["final_norm_d"].dtype == jnp.bfloat16


def test_reshard_to_disjoint_devices(params):
    """Disaggregated: train on devices 0-3, generate on 4-7; device to device, never via host."""
    devices = jax.devices()
    train = train_layout(1, 4, 1, 1, devices[:4])
    rollout = rollout_layout(2, devices[4:])
    p = jax.device_put(params, param_shardings(CONFIG, train))
    with (
        jax.transfer_guard_host_to_device("disallow"),
        jax.transfer_guard_device_to_host("disallow"),
    ):
        rolled = reshard(p, param_shardings(CONFIG, rollout), dtype="bfloat16")
        back = reshard(rolled, param_shardings(CONFIG, train), dtype="float32")
    assert {d.id for d in rolled["layers"]["attn"]["w_q_dnh"].sharding.device_set} == {4, 5, 6, 7}
    jax.tree.map(
        lambda r, x: np.testing.assert_array_equal(r, x.astype(jnp.bfloat16).astype(jnp.float32)),
        back,
        params,
    )


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ((0, 2, P("x")), (2, 6, P("x"))),  # other devices, another cut: whole, copied, cut
        ((0, 4, P("x")), (4, 8, P("x"))),  # other devices, the same cut: shard for shard
        ((0, 2, P()), (2, 6, P("x"))),  # whole on 2, split over 4 others
        ((0, 4, P("x")), (4, 6, P("x"))),  # 4 to 2: the whole copy from 2 of the 4
        ((0, 3, P()), (3, 8, P())),  # 3 to 5: whole copies in two turns (3, then 2)
        ((0, 4, P()), (0, 4, P("x"))),  # the same devices: a jitted identity
    ],
)
def test_moved_reaches_any_devices_without_the_host(source, target):
    """A batch array moved between device groups (a placed role's results) arrives in the
    target sharding with its values, device to device."""
    devices = jax.devices()

    def sharding(start, stop, spec):
        return jax.sharding.NamedSharding(jax.sharding.Mesh(devices[start:stop], ("x",)), spec)

    value = np.arange(60 * 3, dtype=np.float32).reshape(60, 3)  # 60 rows: split 2, 3, 4, 5
    x = jax.device_put(value, sharding(*source))
    with jax.transfer_guard("disallow"):
        out = moved(x, sharding(*target))
    assert out.sharding == sharding(*target)
    np.testing.assert_array_equal(np.asarray(out), value)


def test_reshard_report_bounds_peak_by_bucket(params):
    train, rollout = train_layout(1, 8, 1, 1), rollout_layout(2)
    p = jax.device_put(params, param_shardings(CONFIG, train))
    targets = param_shardings(CONFIG, rollout)
    per_tensor = reshard_report(p, targets, dtype="bfloat16")
    one_program = reshard_report(p, targets, dtype="bfloat16", bucket_bytes=1 << 40)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    # bytes, not floats: 1/8 of the model per device, up to the leaves too small to split 8
    # ways (replicated norms and biases, a few per cent of this tiny model)
    assert per_tensor["params_before"] == pytest.approx(total / 8, rel=0.05)
    assert per_tensor["buckets"] == len(jax.tree.leaves(params)) and one_program["buckets"] == 1
    assert per_tensor["max_bucket_temp"] <= one_program["max_bucket_temp"]
    assert (
        per_tensor["peak"]
        == per_tensor["params_before"] + per_tensor["params_after"] + per_tensor["max_bucket_temp"]
    )
    assert 0 < per_tensor["bytes_moved"] <= 8 * per_tensor["params_after"]


def test_offload_and_reload(params):
    layout = train_layout(1, 8, 1, 1)
    p = jax.device_put(params, param_shardings(CONFIG, layout))
    parked = offload(p)
    assert parked["final_norm_d"].sharding.memory_kind == "pinned_host"
    back = reload(parked)
    assert back["final_norm_d"].sharding.memory_kind == "device"
    assert back["final_norm_d"].sharding.spec == p["final_norm_d"].sharding.spec
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_layouts_from_config():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/m",
            "mesh.fsdp=4",
            "mesh.tp=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "mesh.train_rules.vocab=null",
        ],
        num_devices=8,
    )
    train, rollout = layouts_from_config(cfg)
    assert dict(train.mesh.shape) == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}
    assert dict(rollout.mesh.shape) == {"dp": 2, "tp": 4}
    assert param_shardings(CONFIG, train)["embed"]["tokens_vd"].spec == P(None, "fsdp")


def test_several_processes_give_every_role_a_share_of_their_devices():
    """With 2 processes of 4 devices the trainer takes the first 2 of each and each placed
    role its slice of each; one process keeps the ranges; a count that does not divide by
    the processes is an error naming its key."""
    from types import SimpleNamespace

    from jaxrl.sharding.layouts import _group_devices

    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    groups = {"train": range(4), "rollout": range(4, 6), "critic": range(6, 8)}
    on = _group_devices(groups, devices)
    assert {k: [d.id for d in v] for k, v in on.items()} == {
        "train": [0, 1, 4, 5], "rollout": [2, 6], "critic": [3, 7]}  # fmt: skip
    alone = _group_devices(groups, [SimpleNamespace(id=i, process_index=0) for i in range(8)])
    assert [d.id for d in alone["critic"]] == [6, 7]
    with pytest.raises(ValueError, match=r"mesh.placement.critic.devices \(1\) a multiple of 2"):
        _group_devices({"train": range(7), "critic": range(7, 8)}, devices)
    # spread=false: ranges of the devices in process order, as one process: the critic on
    # process 1's last device, the rollout on 2 of process 1's
    ranged = _group_devices({"train": range(5), "rollout": range(5, 7), "critic": range(7, 8)},
                            devices[::-1], spread=False)  # fmt: skip
    assert {k: [d.id for d in v] for k, v in ranged.items()} == {
        "train": [0, 1, 2, 3, 4], "rollout": [5, 6], "critic": [7]}  # fmt: skip


@pytest.mark.parametrize(
    "placed, extra, first, message",
    [
        (
            {"ref": 2},  # the trainer on process 0's 6 devices: 2 outside, fewer than 6
            ("actor_rollout_ref.actor.use_kl_loss=true", "mesh.fsdp=2", "mesh.tp=3"),
            6,
            r"train on 6 devices of process\(es\) \[0\] only .* on 6 devices that reach "
            r"process\(es\) \[1\], and only 2 are outside it: place more devices on the "
            r"other roles",
        ),
        (
            {"critic": 6},  # the critic on process 1's 6 devices, 2 outside
            (
                "critic.enable=true",
                "mesh.fsdp=2",
                "mesh.placement.critic.fsdp=2",
                "mesh.placement.critic.tp=3",
            ),
            2,
            r"critic on 6 devices of process\(es\) \[1\] only .*mesh.placement.critic",
        ),
        (
            {"rollout": 2},
            (
                "mesh.fsdp=2",
                "mesh.tp=3",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=acc",
                "algorithm.filter_groups.streaming=true",
            ),
            4,
            r"rollout has no device on process\(es\) \[0\] .* "
            r"algorithm.filter_groups.streaming",
        ),
        (
            {"ref": 4},  # the rollout unplaced: on the trainer's devices, process 0's
            (
                "actor_rollout_ref.actor.use_kl_loss=true",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=acc",
                "algorithm.filter_groups.streaming=true",
            ),
            4,
            r"rollout has no device on process\(es\) \[1\]",
        ),
    ],
)
def test_unspread_roles_on_some_processes_are_refused_where_they_cannot_run(
    placed, extra, first, message
):
    """With mesh.placement.spread=false a group may sit on some processes' devices only
    (process 0 holds the first `first` of 8 devices), except a trainer or placed critic with
    fewer devices outside it than its checkpoint's copy needs, and a rollout (placed, or
    the trainer's devices) off a process that streamed dynamic sampling runs on: each is
    refused by name, with the keys to change."""
    from types import SimpleNamespace

    from jaxrl.sharding.layouts import role_layouts

    devices = [SimpleNamespace(id=i, process_index=int(i >= first)) for i in range(8)]
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "mesh.placement.spread=false",
                             *(f"mesh.placement.{r}.devices={n}" for r, n in placed.items()),
                             *extra], num_devices=8)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        role_layouts(cfg, devices)


def test_a_role_on_some_processes_is_checkpointed_through_the_fewest_copies():
    """`copy_groups`: groups of the role's size outside it that reach every process it
    misses, each missing process's first device first; none when it spans every process."""
    from types import SimpleNamespace

    from jaxrl.sharding.reshard import copy_groups

    def ids(groups):
        return [[d.id for d in g] for g in groups]

    two = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    assert ids(copy_groups(two[:4], two, "train")) == [[4, 5, 6, 7]]
    assert copy_groups(two[2:6], two, "train") == []
    three = [SimpleNamespace(id=i, process_index=i // 2) for i in range(6)]
    assert ids(copy_groups(three[:2], three, "critic")) == [[2, 4]]  # one copy reaches both
    assert ids(copy_groups(three[:1], three, "critic")) == [[2], [4]]
    with pytest.raises(ValueError, match=r"critic on 4 devices .* only 2 are outside it"):
        copy_groups(three[:4], three, "critic")


def test_shard_is_a_no_op_without_layout():
    from jaxrl.sharding import shard

    x = jnp.ones((8, 4))
    assert shard(x, ("batch", None)) is x
    layout = train_layout(1, 8, 1, 1)
    with use_layout(layout):
        y = jax.jit(functools.partial(shard, logical=("batch", None)))(x)
    assert y.sharding.is_equivalent_to(layout.sharding((8, 4), ("batch", None)), 2)
    assert {s.data.shape for s in y.addressable_shards} == {(1, 4)}


def test_an_indivisible_parameter_dimension_is_replicated_and_named(caplog):
    from jaxrl.sharding import tree_shardings

    mesh = jax.make_mesh((8,), ("fsdp",))
    abstract = {"w": jax.ShapeDtypeStruct((12, 16), jnp.float32)}
    with caplog.at_level("WARNING", logger="jaxrl.sharding"):
        shardings = tree_shardings(abstract, {"w": ("embed", "mlp")}, mesh, {"embed": "fsdp"})
        tree_shardings(abstract, {"w": ("embed", "mlp")}, mesh, {"embed": "fsdp"})
    assert shardings["w"].spec == P(None, None)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "['w']: dimension 0 (embed, size 12) does not divide over mesh axes fsdp (8 shards): "
        "replicated on them"
    ]  # once
