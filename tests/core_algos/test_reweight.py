"""PF-PPO's resampling (`jaxrl.core_algos.reweight`, `RLBatch.select`) vs verl 0.9.1's
`compute_pf_ppo_reweight_data` on fixed batches.

verl draws the rows with `torch.multinomial` (torch's global RNG), jaxrl from a jax key: the
test captures the weights verl hands `torch.multinomial` (they must equal `pf_ppo_weights`),
makes it return jaxrl's draw, and compares verl's resampled DataProto with the batch jaxrl's
trainer gathers by the same rows.
"""

import jax
import numpy as np
import pytest

import jaxrl.core_algos as C
from jaxrl.testing.reference import import_reference
from jaxrl.trainer.batch import RLBatch

# summed scores with ties at the max and min, zeros and negatives
SCORES = np.array([1.0, 0.0, -1.0, 1.0, 0.5, -1.0, 0.0, 2.0], np.float32)
METHODS = [("pow", 2.0), ("pow", 1.0), ("pow", 0.5), ("max_min", 2.0), ("max_random", 2.0)]


def _host_batch(r=5, seed=0):
    n = len(SCORES)
    rng = np.random.default_rng(seed)
    scores = np.zeros((n, r), np.float32)
    lengths = rng.integers(1, r + 1, n)
    scores[np.arange(n), lengths - 1] = SCORES[:n]  # on each response's last token
    return {
        "prompts": rng.integers(3, 30, (n, 3)),
        "prompt_mask": np.ones((n, 3), np.int32),
        "responses": rng.integers(3, 30, (n, r)),
        "response_mask": (np.arange(r)[None] < lengths[:, None]).astype(np.int32),
        "group_ids": np.arange(n) // 2,
        "token_level_scores": scores,
        "advantages": rng.normal(size=(n, r)).astype(np.float32),
        "returns": rng.normal(size=(n, r)).astype(np.float32),
        "values": rng.normal(size=(n, r)).astype(np.float32),
    }


def _verl_resampled(monkeypatch, host, method, power, rows):
    """verl's resampled batch with `torch.multinomial` returning `rows`; the weights it got."""
    torch = pytest.importorskip("torch")
    verl = import_reference()
    protocol = import_reference("verl.protocol")
    captured = {}

    def multinomial(weights, num_samples, replacement):
        captured["weights"] = weights.numpy().copy()
        assert replacement and num_samples == len(weights)
        return torch.as_tensor(np.asarray(rows), dtype=torch.int64)

    monkeypatch.setattr(torch, "multinomial", multinomial)
    tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in host.items() if k != "group_ids"}
    uids = np.array([f"uid{g}" for g in host["group_ids"]], dtype=object)
    data = protocol.DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})
    out = verl.compute_pf_ppo_reweight_data(data, method, power)
    return out, captured["weights"]


@pytest.mark.parametrize(("method", "power"), METHODS)
def test_resampled_batch_equals_verls(monkeypatch, method, power):
    host = _host_batch()
    key = jax.random.key(3)
    rows = np.asarray(
        jax.jit(C.pf_ppo_indices, static_argnums=(2, 3))(
            key, host["token_level_scores"].sum(-1), method, power
        )
    )
    ref, ref_weights = _verl_resampled(monkeypatch, host, method, power, rows)
    # float32 elementwise powers and shifts of the same 8 scores on both sides: a few roundings
    # (1.2e-7 relative each) at most, relative (the max_min weights include 1e-8); measured
    # exact.
    np.testing.assert_allclose(
        np.asarray(C.pf_ppo_weights(SCORES, method, power)), ref_weights, rtol=1e-6, atol=0
    )
    batch = RLBatch.from_host(
        {k: v for k, v in host.items() if k not in ("advantages", "returns", "values")}, None
    ).replace(**{k: jax.numpy.asarray(host[k]) for k in ("advantages", "returns", "values")})
    got = batch.select(rows)
    for name, value in ref.batch.items():
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), value.numpy(), name)
    want_uids = np.array([f"uid{g}" for g in np.asarray(got.group_ids)], dtype=object)
    np.testing.assert_array_equal(ref.non_tensor_batch["uid"], want_uids)
    assert got.response_lengths == tuple(int(x) for x in ref.batch["response_mask"].sum(-1))


@pytest.mark.parametrize(("method", "power"), METHODS)
def test_draws_follow_the_weights(method, power):
    """Over 20000 draws each row's frequency is its weight's share (binomial 5-sigma band)."""
    draws = 20000
    keys = jax.random.split(jax.random.key(0), draws // len(SCORES))
    rows = jax.vmap(lambda k: C.pf_ppo_indices(k, SCORES, method, power))(keys).ravel()
    counts = np.bincount(np.asarray(rows), minlength=len(SCORES))
    weights = np.asarray(C.pf_ppo_weights(SCORES, method, power), np.float64)
    p = weights / weights.sum()
    band = 5 * np.sqrt(draws * p * (1 - p)) + 1
    assert (np.abs(counts - draws * p) <= band).all(), (counts, draws * p)
    if method == "max_min":
        assert counts[[1, 4, 6]].sum() == 0  # weight 1e-8: never drawn in 20000


def test_unknown_method_names_the_key():
    with pytest.raises(ValueError, match=r"algorithm\.pf_ppo\.reweight_method='best'"):
        C.pf_ppo_weights(SCORES, "best")
