"""Every cross-field and value check: what it refuses and what its message tells the user."""

import logging

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.checks import check_model_context, critic_enabled

BASE = [
    "actor_rollout_ref.model.path=/models/m",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
]


def problem(*overrides, num_devices=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, *overrides], num_devices=num_devices)
    (msg,) = info.value.problems
    return msg


def ok(*overrides, num_devices=None):
    return load_config(None, [*BASE, *overrides], num_devices=num_devices)


# ------------------------------------------------------------------------- batch arithmetic


def test_train_batch_must_hold_whole_mini_batches():
    msg = problem("actor_rollout_ref.actor.ppo_mini_batch_size=24")
    assert "data.train_batch_size (64)" in msg
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (24)" in msg
    assert "one of [16, 32" in msg  # divisors of 64 nearest 24


def test_mini_batch_larger_than_train_batch():
    msg = problem("actor_rollout_ref.actor.ppo_mini_batch_size=128")
    assert "must be a multiple of" in msg


def test_critic_mini_batch_checked_only_when_critic_runs():
    msg = problem("critic.ppo_mini_batch_size=48")  # gae: critic on
    assert "critic.ppo_mini_batch_size (48)" in msg
    ok("critic.ppo_mini_batch_size=48", "algorithm.adv_estimator=grpo")


def test_mini_batch_splits_over_data_parallel_shards():
    msg = problem(
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=3",
        "algorithm.adv_estimator=grpo",
        num_devices=4,
    )
    assert "2 x 3 = 6 sequences" in msg and "4 data-parallel shards" in msg
    # tp does not split the batch: 6 sequences over dp x fsdp = 2 is fine.
    ok(
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=3",
        "algorithm.adv_estimator=grpo",
        "mesh.tp=2",
        num_devices=4,
    )


def test_micro_batch_must_divide_mini_batch_per_shard():
    # 16 prompts x 4 samples / 8 shards = 8 sequences per shard; micro 3 does not divide it.
    msg = problem(
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        num_devices=8,
    )
    assert "ppo_micro_batch_size_per_gpu (3)" in msg and "8 sequences" in msg
    assert "one of [2, 4" in msg
    ok(
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        num_devices=8,
    )
    # With dynamic batch size the micro-batch count is ignored, as in verl.
    ok(
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        num_devices=8,
    )


def test_dynamic_token_budget_must_hold_a_sequence():
    msg = problem(
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
        "algorithm.adv_estimator=grpo",
    )
    assert "ppo_max_token_len_per_gpu (1000)" in msg and "1024" in msg


# ------------------------------------------------------------------------------------ mesh


def test_mesh_product_must_equal_device_count():
    msg = problem("mesh.fsdp=2", "mesh.tp=2", num_devices=8)
    assert (
        msg.startswith("mesh.dp, mesh.fsdp, mesh.ep, mesh.tp, mesh.sp: ")
        and "spans 4 devices but 8 are available" in msg
    )
    cfg = ok("mesh.fsdp=-1", "mesh.tp=2", num_devices=8)
    assert cfg.mesh.fsdp == -1  # resolved only when the mesh is built


def test_attention_implementation_fits_the_mesh():
    msg = problem("actor_rollout_ref.model.attention_impl=ring", num_devices=8)
    assert "attention_impl=ring needs a sequence-parallel mesh" in msg and "mesh.sp" in msg
    ok("actor_rollout_ref.model.attention_impl=ring", "mesh.sp=2", num_devices=8)
    msg = problem("actor_rollout_ref.model.attention_impl=cudnn")
    assert "attention_impl: 'cudnn' is not one of auto, reference, blockwise" in msg


def test_mesh_rest_must_divide():
    msg = problem("mesh.tp=3", num_devices=8)
    assert "cannot be split" in msg


def test_mesh_only_one_rest_axis():
    msg = problem("mesh.dp=-1", num_devices=8)
    assert "only one mesh axis may be -1" in msg


def test_mesh_sizes_positive():
    msg = problem("mesh.tp=0", num_devices=8)
    assert "tp=0" in msg


def test_rollout_tp_must_divide_devices():
    msg = problem("actor_rollout_ref.rollout.tensor_model_parallel_size=3", num_devices=8)
    assert "tensor_model_parallel_size (3) must divide the rollout's 8 devices" in msg


def test_nodes_times_gpus_must_match_devices():
    msg = problem("trainer.n_gpus_per_node=8", "trainer.nnodes=2", num_devices=8)
    assert "2 x 8" in msg and "JAX sees 8 devices" in msg
    ok("trainer.n_gpus_per_node=8", "trainer.nnodes=1", num_devices=8)


# --------------------------------------------------------------------------------- choices


@pytest.mark.parametrize(
    "override, hint",
    [
        ("algorithm.adv_estimator=grpp", "did you mean 'grpo'"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gsp", "did you mean 'gspo'"),
        ("actor_rollout_ref.actor.loss_agg_mode=token_mean", "did you mean 'token-mean'"),
        ("actor_rollout_ref.actor.kl_loss_type=low_var", "did you mean 'low_var_kl'"),
        ("algorithm.kl_penalty=k4", None),
        ("algorithm.kl_ctrl.type=adaptiv", "did you mean 'adaptive'"),
        ("data.truncation=both", None),
        ("trainer.resume_mode=latest", None),
        ("actor_rollout_ref.model.remat_policy=dots", "did you mean 'save_dots'"),
        ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosin", "did you mean 'cosine'"),
        ("reward_model.reward_manager=naiv", "did you mean 'naive'"),
    ],
)
def test_choices_name_key_value_and_options(override, hint):
    key, value = override.split("=")
    msg = problem(override)
    assert msg.startswith(f"{key}: '{value}' is not one of")
    if hint:
        assert hint in msg


def test_unknown_logger():
    assert "unknown logger 'mlflow'" in problem("trainer.logger=[console,mlflow]")


def test_unknown_dtype_and_optimizer():
    assert "unknown dtype 'int8'" in problem("actor_rollout_ref.rollout.dtype=int8")
    assert "unknown optimizer 'sgd'" in problem("actor_rollout_ref.actor.optim.optimizer=sgd")
    cfg = ok("actor_rollout_ref.actor.optim.optimizer=adamw", "critic.dtype=fp16")
    assert cfg.actor_rollout_ref.actor.optim.optimizer == "AdamW"
    assert cfg.critic.dtype == "float16"


def test_kl_straight_through_variants_accepted():
    ok("actor_rollout_ref.actor.kl_loss_type=low_var_kl+", "algorithm.kl_penalty=k3+")


# ---------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "override, text",
    [
        ("data.train_batch_size=0", "data.train_batch_size must be >= 1, got 0"),
        ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n must be >= 1"),
        ("actor_rollout_ref.actor.ppo_epochs=0", "ppo_epochs must be >= 1"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "must be >= 1, got 0"),
        ("actor_rollout_ref.actor.clip_ratio=0", "clip_ratio must be > 0"),
        ("actor_rollout_ref.actor.grad_clip=-1", "grad_clip must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", "clip_ratio_c must be > 1"),
        ("actor_rollout_ref.actor.optim.lr=-1e-6", "optim.lr must be >= 0"),
        ("critic.optim.lr_warmup_steps_ratio=1.5", "lr_warmup_steps_ratio must be in [0.0, 1.0]"),
        ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", "betas must be two numbers in [0, 1)"),
        ("trainer.save_freq=0", "trainer.save_freq must be -1 (off) or >= 1"),
        ("trainer.total_training_steps=0", "total_training_steps must be >= 1"),
        ("actor_rollout_ref.rollout.top_k=0", "top_k must be -1 (off) or >= 1"),
        ("actor_rollout_ref.rollout.top_p=0", "top_p must be in (0, 1]"),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", "temperature must be >= 0"),
    ],
)
def test_ranges(override, text):
    assert text in problem(override)


def test_training_temperature_must_be_positive():
    msg = problem("actor_rollout_ref.rollout.temperature=0")
    assert "logits / temperature" in msg and "do_sample=false" in msg
    ok("actor_rollout_ref.rollout.val_kwargs.temperature=0")  # greedy validation is fine


def test_rollout_lengths():
    msg = problem("actor_rollout_ref.rollout.prompt_length=100")
    assert "shorter than data.max_prompt_length (512)" in msg
    msg = problem("actor_rollout_ref.rollout.max_model_len=1000")
    assert "below prompt_length + response_length (1024)" in msg


# ------------------------------------------------------------------------------- algorithm


def test_gae_needs_critic():
    msg = problem("critic.enable=false")
    assert "gae needs a critic" in msg and "grpo" in msg


def test_critic_enabled_rule():
    assert critic_enabled(ok())  # gae, enable null
    assert not critic_enabled(ok("algorithm.adv_estimator=grpo"))
    assert critic_enabled(ok("algorithm.adv_estimator=grpo", "critic.enable=true"))


def test_resume_path_needs_a_path():
    assert "trainer.resume_from_path" in problem("trainer.resume_mode=resume_path")


def test_adaptive_kl_needs_positive_target():
    msg = problem("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0")
    assert "target_kl > 0" in msg


def test_double_kl_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl.config"):
        ok("actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true")
    assert "penalised twice" in caplog.text


def test_model_context():
    cfg = ok("data.max_prompt_length=2048", "data.max_response_length=4096")
    with pytest.raises(ConfigError) as info:
        check_model_context(cfg, 4096, "actor_rollout_ref.model.path=/m")
    (msg,) = info.value.problems
    assert "6144 tokens exceeds" in msg and "max_position_embeddings = 4096" in msg
    check_model_context(cfg, 8192, "actor_rollout_ref.model.path=/m")
    check_model_context(cfg, None, "actor_rollout_ref.model.path=/m")  # unknown: no check


def test_critic_micro_batch_checked_when_mini_follows_actor():
    msg = problem("critic.ppo_micro_batch_size_per_gpu=3", num_devices=8)
    assert msg.startswith("critic.ppo_micro_batch_size_per_gpu (3)")
    assert "actor_rollout_ref.actor" not in msg


def test_rollout_correction_in_both_modes():
    ok("algorithm.rollout_correction.rollout_is=token")  # decoupled
    ok(
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.bypass_mode=true",
    )
    msg = problem("algorithm.rollout_correction.rollout_rs=token_k1")
    assert "rollout_rs_threshold" in msg


def test_pf_ppo_needs_gae_and_a_known_method():
    msg = problem("algorithm.use_pf_ppo=true", "algorithm.adv_estimator=grpo")
    assert "algorithm.adv_estimator=gae" in msg and "silently does nothing" in msg
    msg = problem("algorithm.adv_estimator=gae", "algorithm.pf_ppo.reweight_method=maxmin")
    assert "did you mean 'max_min'" in msg
    ok(
        "algorithm.use_pf_ppo=true",
        "algorithm.adv_estimator=gae",
        "algorithm.pf_ppo.reweight_method=max_random",
        "algorithm.pf_ppo.weight_pow=1.5",
    )


def test_optimal_token_baseline_needs_sum_pi_squared_and_no_bypass():
    otb = "algorithm.adv_estimator=optimal_token_baseline"
    assert "calculate_sum_pi_squared=true" in problem(otb)
    spi = "actor_rollout_ref.actor.calculate_sum_pi_squared=true"
    msg = problem(otb, spi, "algorithm.rollout_correction.bypass_mode=true")
    assert "bypass mode skips the old-log-prob pass" in msg
    ok(otb, spi)
    ok("algorithm.adv_estimator=tir_optimal_token_baseline", spi)


def test_dynamic_sampling_keys():
    assert "needs algorithm.filter_groups.metric" in problem("algorithm.filter_groups.enable=true")
    fg = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward"]
    assert "verl's recipe fails here too" in problem(*fg, "algorithm.use_kl_in_reward=true")
    assert "without algorithm.filter_groups.enable" in problem("data.gen_batch_size=16")
    cfg = ok(*fg, "data.gen_batch_size=16", "algorithm.filter_groups.max_num_gen_batches=5",
             "algorithm.filter_groups.max_inflight_gen_batches=2")  # fmt: skip
    assert cfg.data.gen_batch_size == 16 and cfg.algorithm.filter_groups.max_num_gen_batches == 5


def test_streamed_dynamic_sampling_keys():
    stream = "algorithm.filter_groups.streaming=true"
    assert "set algorithm.filter_groups.enable=true too" in problem(stream)
    fg = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", stream]
    assert ok(*fg).algorithm.filter_groups.streaming
    assert "multi_turn" in problem(*fg, "actor_rollout_ref.rollout.multi_turn.enable=true")
    assert "set the rate to 0" in problem(*fg, "actor_rollout_ref.rollout.over_sample_rate=0.2")
    assert "ReMax" in problem(*fg, "algorithm.adv_estimator=remax")
    text = problem(*fg, "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.max_num_seqs=4")
    assert "max_num_seqs (4) to at least 8" in text


def test_an_external_agent_needs_multi_turn_and_its_own_rewards():
    key = "actor_rollout_ref.rollout.agent.external"
    ok(f"{key}=agent.py:run", "actor_rollout_ref.rollout.multi_turn.enable=true")
    assert "multi_turn.enable=true" in problem(f"{key}=agent.py:run")
    assert "module:function" in problem(
        f"{key}=agent.py", "actor_rollout_ref.rollout.multi_turn.enable=true"
    )
    on = [f"{key}=agent.py:run", "actor_rollout_ref.rollout.multi_turn.enable=true"]
    for setting, named in (("reward_model.overlong_buffer.enable=true", "overlong_buffer"),
                           ("custom_reward_function.path=score.py", "custom_reward_function"),
                           ("algorithm.adv_estimator=remax", "remax")):  # fmt: skip
        message = problem(*on, setting)
        assert named in message and "returns each episode's reward" in message, setting
    assert "tool_config_path=null" in problem(
        *on, "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml"
    )
