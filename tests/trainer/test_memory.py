"""The memory plan's arithmetic (`jaxrl.trainer.memory`) on programs whose sizes are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.trainer.memory import ProgramMemory, bytes_per_device, memory_plan, worst_case_batch


def test_a_donated_update_adds_its_transient_input_and_temporaries():
    state = jnp.zeros((1024,), jnp.float32)  # 4 KiB, resident
    grads = jnp.ones((1024,), jnp.float32)  # 4 KiB, made for the call
    update = jax.jit(lambda s, g: s - 0.1 * g, donate_argnums=0)
    stats = ProgramMemory.of(update.lower(state, grads).compile())
    assert stats.arguments == 8192 and stats.outputs == 4096 and stats.aliased == 4096
    assert stats.beyond(resident=4096) == 4096 + stats.temporaries
    plan = memory_plan({"update": update.lower(state, grads).compile()}, {"role": state},
                       {"update": state})  # fmt: skip
    assert plan.resident == {"role": 4096} and plan.largest == "update"
    assert plan.peak == 4096 + 4096 + stats.temporaries


def test_bytes_per_device_counts_one_shard():
    mesh = jax.make_mesh((8,), ("x",))
    sharded = jax.device_put(np.zeros(8192, np.float32), NamedSharding(mesh, PartitionSpec("x")))
    replicated = jax.device_put(np.zeros(100, np.int8), NamedSharding(mesh, PartitionSpec()))
    abstract = jax.ShapeDtypeStruct((8192,), jnp.bfloat16, sharding=sharded.sharding)
    assert bytes_per_device({"a": sharded, "b": replicated}) == 4096 + 100
    assert bytes_per_device(abstract) == 2048


def test_worst_case_batch_has_one_full_row_among_short_ones():
    batch = worst_case_batch(5, prompt_len=6, response_len=4, fields=("advantages",))
    prompt, response = batch.lengths()
    assert prompt.tolist() == [6, 1, 1, 1, 1] and response.tolist() == [4, 1, 1, 1, 1]
    assert batch.prompts.shape == (5, 6) and batch.loss_mask.shape == (5, 4)
    assert batch.advantages.shape == (5, 4) and batch.advantages.dtype == np.float32
    assert batch.values is None  # not asked for: absent, not zeros
