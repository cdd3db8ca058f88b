"""Loading: YAML files, Hydra-syntax overrides of every value type, verl key handling, errors."""

import dataclasses
import logging
import shlex
import textwrap
from pathlib import Path

import pytest

from jaxrl.config import Config, ConfigError, load_config, save_config, to_yaml
from jaxrl.config.checks import role_devices, teacher_roles
from jaxrl.config.load import closest_key, schema_index

MODEL = "actor_rollout_ref.model.path=/models/m"


def load(*overrides, path=None, **kw):
    return load_config(path, [MODEL, *overrides], **kw)


def problems(*overrides, path=None, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path, **kw)
    return info.value.problems


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_are_verls():
    cfg = load()
    assert cfg.data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False
    assert cfg.trainer.resume_mode == "auto"


def test_override_value_types():
    cfg = load(
        "data.train_batch_size=512",  # int
        "actor_rollout_ref.actor.optim.lr=3e-6",  # float in exponent form
        "actor_rollout_ref.actor.clip_ratio_high=0.28",  # float
        "data.shuffle=false",  # bool
        "actor_rollout_ref.actor.use_kl_loss=True",  # bool, Python spelling
        "algorithm.adv_estimator=grpo",  # bare string
        "trainer.experiment_name='my run: 1'",  # quoted string with spaces and a colon
        "data.train_files=[/d/a.parquet,/d/b.parquet]",  # list
        "trainer.logger=['console','tensorboard']",  # list of quoted strings
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",  # list of floats
        "data.seed=7",
        "data.seed=null",  # null after a value: the later override wins
        "data.val_batch_size=16",
        "actor_rollout_ref.model.override_config={attention_dropout: 0.0, rope_theta: 1e6}",
        "data.apply_chat_template_kwargs.enable_thinking=false",  # key inside a free mapping
        "+actor_rollout_ref.rollout.top_k=20",  # Hydra's append prefix on a known key
        "actor_rollout_ref.rollout.temperature=2",  # int into a float key
    )
    assert cfg.data.train_batch_size == 512
    # exact: the text parses to the same float as Python's literal
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.data.shuffle is False
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.experiment_name == "my run: 1"
    assert cfg.data.train_files == ("/d/a.parquet", "/d/b.parquet")
    assert cfg.trainer.logger == ("console", "tensorboard")
    assert cfg.actor_rollout_ref.actor.optim.betas == (0.9, 0.95)
    assert cfg.data.seed is None
    assert cfg.data.val_batch_size == 16
    assert dict(cfg.actor_rollout_ref.model.override_config) == {
        "attention_dropout": 0.0,
        "rope_theta": 1e6,
    }
    assert dict(cfg.data.apply_chat_template_kwargs) == {"enable_thinking": False}
    assert cfg.actor_rollout_ref.rollout.top_k == 20
    assert cfg.actor_rollout_ref.rollout.temperature == 2.0
    assert isinstance(cfg.actor_rollout_ref.rollout.temperature, float)


def test_single_file_becomes_a_tuple():
    assert load("data.train_files=/d/train.parquet").data.train_files == ("/d/train.parquet",)


def test_interpolations_follow_verl():
    cfg = load(
        "data.max_prompt_length=1024",
        "data.max_response_length=2048",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "trainer.project_name=p",
        "trainer.experiment_name=e",
    )
    assert cfg.actor_rollout_ref.rollout.prompt_length == 1024
    assert cfg.actor_rollout_ref.rollout.response_length == 2048
    assert cfg.critic.ppo_mini_batch_size == 32
    assert cfg.critic.use_dynamic_bsz is True
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.model.path == "/models/m"
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"
    # A user's own interpolation on the command line.
    cfg = load("data.max_response_length=${data.max_prompt_length}")
    assert cfg.data.max_response_length == cfg.data.max_prompt_length == 512


def test_yaml_then_overrides(tmp_path):
    path = write(
        tmp_path,
        """
        data:
          train_batch_size: 128
          max_prompt_length: 256
        actor_rollout_ref:
          actor:
            ppo_mini_batch_size: 32
            optim: {lr: 2.0e-6}
        critic:
        """,
    )
    cfg = load("data.train_batch_size=64", path=path)
    assert cfg.data.train_batch_size == 64  # the command line wins
    assert cfg.data.max_prompt_length == 256
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-6


def test_config_is_frozen():
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.train_batch_size = 1
    with pytest.raises(TypeError):
        cfg.actor_rollout_ref.model.override_config["x"] = 1
    assert isinstance(cfg.trainer.logger, tuple)


def test_round_trip_through_yaml(tmp_path):
    cfg = load("algorithm.adv_estimator=grpo", "data.train_files=[a,b]", "trainer.logger=[console]")
    path = save_config(cfg, tmp_path / "run")
    assert path.read_text() == to_yaml(cfg)
    assert load_config(path) == cfg


def test_unknown_key_names_closest():
    (msg,) = problems("actor_rollout_ref.actor.ppo_mini_bach_size=4")
    assert "'actor_rollout_ref.actor.ppo_mini_bach_size'" in msg
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in msg


def test_unknown_group_names_closest():
    (msg,) = problems("actor_rollout_ref.actr.ppo_epochs=2")
    assert "did you mean 'actor_rollout_ref.actor.ppo_epochs'" in msg


def test_key_in_the_wrong_group_names_its_home():
    (msg,) = problems("data.ppo_mini_batch_size=4")
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in msg


def test_unknown_key_in_yaml(tmp_path):
    path = write(tmp_path, "algorithm:\n  adv_estimater: grpo\n")
    (msg,) = problems(path=path)
    assert "algorithm.adv_estimater" in msg and "'algorithm.adv_estimator'" in msg


def test_all_problems_reported_together():
    msgs = problems("data.max_prompt_lenght=4", "trainer.totl_epochs=1", "data.shuffle=maybe")
    assert len(msgs) == 3


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.train_batch_size=abc", "expected an integer"),
        ("data.train_batch_size=1.5", "expected an integer"),
        ("data.shuffle=maybe", "expected a boolean"),
        ("actor_rollout_ref.actor.optim.lr=fast", "expected a number"),
        ("data.seed=x", "expected an integer or null"),
        ("actor_rollout_ref.actor.optim.betas=[a,b]", "expected a list of 2 numbers"),
        ("actor_rollout_ref.model.override_config=5", "expected a mapping"),
    ],
)
def test_bad_type_names_key_value_and_type(override, expected):
    (msg,) = problems(override)
    key, value = override.split("=", 1)
    assert msg.startswith(key + ":")
    assert expected in msg
    assert value.strip("[]").split(",")[0] in msg


def test_group_given_a_value():
    (msg,) = problems("actor_rollout_ref.actor=5")
    assert "is a group of keys" in msg and "actor_rollout_ref.actor." in msg


def test_required_model_path():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path is required"):
        load_config(None, [])


def test_bad_interpolation_names_key():
    (msg,) = problems("data.max_response_length=${data.no_such_key}")
    assert msg.startswith("data.max_response_length")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("5\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)


@pytest.mark.parametrize(
    "override, match",
    [
        ("data.train_batch_size=1,2", "sweeps"),
        ("~data.seed", "deleting keys"),
        ("data.train_files=[a,", "cannot parse override"),
        ("data.train_files=~/data/x.parquet", "data.train_files='~/data/x.parquet'"),
    ],
)
def test_unsupported_hydra_forms(override, match):
    (msg,) = problems(override)
    assert match in msg


def test_renamed_verl_keys(caplog):
    with caplog.at_level(logging.INFO, logger="jaxrl.config"):
        cfg = load(
            "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
            "actor_rollout_ref.actor.optim.clip_grad=0.5",
            "reward.reward_manager.name=batch",
            "reward.reward_model.model_path=/rm",
        )
    assert cfg.actor_rollout_ref.actor.model_dtype == "bfloat16"
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert cfg.reward_model.reward_manager == "batch"
    assert cfg.reward_model.model.path == "/rm"
    assert "actor_rollout_ref.actor.model_dtype" in caplog.text


def test_ignored_verl_keys_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl.config"):
        cfg = load(
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
        )
    assert cfg == load()
    assert "gpu_memory_utilization" in caplog.text and "vLLM" in caplog.text
    assert "fsdp_config.wrap_policy" in caplog.text


def test_verl_offload_keys_are_jaxrls():
    """verl's FSDP offload keys set jaxrl's (the older and newer critic spellings alike)."""
    cfg = load(
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.param_offload=True",
        "critic.fsdp.optimizer_offload=True",
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.param_offload and actor.optimizer_offload
    assert cfg.actor_rollout_ref.ref.param_offload
    assert cfg.critic.param_offload and cfg.critic.optimizer_offload


def test_ignored_verl_key_with_result_changing_value_is_an_error():
    (msg,) = problems("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert "mesh.sp" in msg
    (msg,) = problems("transfer_queue.enable=true")
    assert "not supported by jaxrl" in msg and "False" in msg
    (msg,) = problems("actor_rollout_ref.model.lora.rank=8")
    assert "Megatron's LoRA" in msg and "lora_rank" in msg
    # The accepted value itself passes.
    load("actor_rollout_ref.model.lora.rank=0", "transfer_queue.enable=false")


def test_lora_keys():
    """verl's FSDP LoRA keys load as given; a negative rank or non-positive alpha is named."""
    cfg = load(
        "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "critic.model.lora_rank=8",
    )
    assert cfg.actor_rollout_ref.model.lora_rank == 16
    assert list(cfg.actor_rollout_ref.model.target_modules) == ["q_proj", "v_proj"]
    assert cfg.critic.model.lora_rank == 8 and cfg.critic.model.target_modules == "all-linear"
    (msg,) = problems("actor_rollout_ref.model.lora_rank=-1")
    assert "actor_rollout_ref.model.lora_rank must be >= 0" in msg
    (msg,) = problems("critic.model.lora_rank=4", "critic.model.lora_alpha=0")
    assert "critic.model.lora_alpha must be > 0" in msg


VERL_PPO_DEEPSEEK = """
algorithm.adv_estimator=gae data.train_files=$HOME/data/gsm8k/train.parquet
data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=512 data.filter_overlong_prompts=True
data.truncation='error' actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
critic.model.use_remove_padding=True critic.model.path=deepseek-ai/deepseek-llm-7b-chat
critic.model.enable_gradient_checkpointing=False critic.ppo_micro_batch_size_per_gpu=8
critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=['console','wandb']
trainer.project_name='verl_example_gsm8k' trainer.experiment_name='deepseek_llm_7b_function_rm'
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1
trainer.total_epochs=15
"""

VERL_GRPO_QWEN3 = """
algorithm.adv_estimator=grpo data.train_files=/d/gsm8k/train.parquet
data.val_files=/d/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path=Qwen/Qwen3-8B actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger='["console","wandb"]' trainer.project_name='verl_grpo'
trainer.experiment_name='qwen3_8b_function_rm' trainer.n_gpus_per_node=8 trainer.nnodes=1
trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""


@pytest.mark.parametrize("command", [VERL_PPO_DEEPSEEK, VERL_GRPO_QWEN3])
def test_verl_example_command_lines_load(command):
    """verl's own example scripts, verbatim, on the 8 devices they name."""
    cfg = load_config(None, shlex.split(command), num_devices=8)
    assert cfg.trainer.n_gpus_per_node == 8
    assert "wandb" in cfg.trainer.logger
    assert cfg.data.truncation == "error"


def test_closest_key_prefers_siblings():
    assert closest_key("critic.ppo_mini_bach_size") == "critic.ppo_mini_batch_size"
    assert closest_key("zzzzzz.qqqqq") is None


def test_schema_index_covers_every_field():
    index = schema_index()
    assert index["actor_rollout_ref.actor.policy_loss"].kind == "group"
    assert index["actor_rollout_ref.actor.policy_loss.loss_mode"].kind == "leaf"
    assert index["data.apply_chat_template_kwargs"].kind == "mapping"
    leaves = [k for k, i in index.items() if i.kind != "group"]
    assert len(leaves) > 150
    assert all(dataclasses.is_dataclass(i.type) for i in index.values() if i.kind == "group")
    assert Config.__dataclass_params__.frozen
    (msg,) = problems(
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "mesh.placement.ref.devices=2",
        num_devices=8,
    )
    assert "mesh.placement.ref.devices=2 with LoRA" in msg and "unset mesh.placement.ref" in msg


def test_distillation_keys_as_verls_yaml_and_its_refusals(tmp_path):
    """verl 0.9.1's distillation yaml loads as it is (its `_target_` markers ignored, the
    teacher's vLLM `inference.*` kept); verl's refusals and what jaxrl does not build yet are
    named by key."""
    import yaml

    verl_yaml = pytest.importorskip("verl").__file__.replace(
        "__init__.py", "trainer/config/distillation/distillation.yaml"
    )
    tree = yaml.safe_load(Path(verl_yaml).read_text())
    tree.pop("defaults")
    tree["enabled"] = True
    tree["teacher_models"]["teacher_model"]["model_path"] = "/teacher"
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump({"distillation": tree}))
    cfg = load(path=path)
    loss = cfg.distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_policy_gradient) == ("k3", 32, False)
    assert (
        cfg.distillation.teacher_models["teacher_model"]["inference"]["tensor_model_parallel_size"]
        == 2
    )

    teacher = "distillation.teacher_models.teacher_model.model_path=/t"
    (msg,) = problems("distillation.enabled=true")
    assert "teacher_model.model_path" in msg
    (msg,) = problems("distillation.enabled=true", teacher,
                      "distillation.distillation_loss.loss_mode=k1")  # fmt: skip
    assert "use_policy_gradient" in msg
    (msg,) = problems("distillation.enabled=true", teacher,
                      "distillation.distillation_loss.loss_mode=forward_kl_topk",
                      "distillation.distillation_loss.topk=0")  # fmt: skip
    assert "topk >= 1" in msg
    (msg,) = problems("distillation.enabled=true", teacher,
                      "distillation.distillation_loss.loss_mode=k4")  # fmt: skip
    assert "forward_kl_topk" in msg
    (msg,) = problems("distillation.enabled=true", teacher,
                      "+distillation.teacher_models.math.model_path=/m")  # fmt: skip
    assert "teacher_models.math.key is not set" in msg and "teacher_key='data_source'" in msg
    (msg,) = problems("distillation.enabled=true", "+distillation.teacher_models.a.key=gsm",
                      "+distillation.teacher_models.a.model_path=/a",
                      "+distillation.teacher_models.b.key=geo")  # fmt: skip
    assert "teacher_models.b.model_path is not set" in msg
    (msg,) = problems("distillation.enabled=true", "+distillation.teacher_models.a.key=gsm",
                      "+distillation.teacher_models.a.model_path=/a",
                      "+distillation.teacher_models.b.key=gsm",
                      "+distillation.teacher_models.b.model_path=/b")  # fmt: skip
    assert "teacher_models.b.key='gsm' is also the key of distillation.teacher_models.a" in msg
    (msg,) = problems("distillation.enabled=true", "+distillation.teacher_models.a.key=1",
                      "+distillation.teacher_models.a.model_path=/a",
                      "+distillation.teacher_models.b.key='1'",
                      "+distillation.teacher_models.b.model_path=/b")  # fmt: skip
    assert "b.key='1' is also the key of distillation.teacher_models.a" in msg  # verl: strings
    (msg,) = problems("distillation.enabled=true", teacher,
                      "+distillation.teacher_models.teacher_model.path=/x")  # fmt: skip
    assert "unknown keys ['path']" in msg
    (msg,) = problems("distillation.enabled=true", teacher, "distillation.nnodes=1",
                      "distillation.n_gpus_per_node=2", "mesh.placement.teacher.devices=4",
                      num_devices=8)  # fmt: skip
    assert "mesh.placement.teacher.devices=4" in msg
    (msg,) = problems("distillation.enabled=true", teacher,
                      "distillation.teacher_models.teacher_model.inference=3")  # fmt: skip
    assert "inference must be a mapping" in msg
    placed = load("distillation.enabled=true", teacher, "distillation.nnodes=1",
                  "distillation.n_gpus_per_node=4", num_devices=8)  # fmt: skip
    assert len(role_devices(placed, 8)["teacher"]) == 4


def test_over_sample_rate_range_and_refusals():
    """verl's `rollout.over_sample_rate` loads in [0, 1); a rate that lets no row of a
    generation finish, or one beside multi-turn rollouts, is named."""
    cfg = load("actor_rollout_ref.rollout.over_sample_rate=0.25")
    assert cfg.actor_rollout_ref.rollout.over_sample_rate == 0.25
    (msg,) = problems("actor_rollout_ref.rollout.over_sample_rate=1.5")
    assert "[0, 1)" in msg
    rows = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    (msg,) = problems(*rows, "actor_rollout_ref.rollout.over_sample_rate=0.9")
    assert "= 0 of a generation's 4 rows" in msg
    (msg,) = problems("actor_rollout_ref.rollout.over_sample_rate=0.25",
                      "actor_rollout_ref.rollout.multi_turn.enable=true")  # fmt: skip
    assert "single-turn" in msg


def test_teachers_resolve_as_verls(caplog):
    """One entry is the one teacher (role `teacher`, every row); of several, verl drops the
    default `teacher_model` (a warning names it here) and routes by each entry's `key`."""
    one = load(
        "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t"
    )
    assert teacher_roles(one) == {"teacher": ("teacher_model", None)}
    entries = [f"+distillation.teacher_models.{name}.{k}={v}"
               for name, key in (("math", "openai/gsm8k"), ("geo", "geometry3k"))
               for k, v in (("key", key), ("model_path", f"/{name}"))]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="jaxrl.config"):
        several = load(
            "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t",
            *entries,
        )  # fmt: skip
    assert teacher_roles(several) == {
        "teacher:openai/gsm8k": ("math", "openai/gsm8k"),
        "teacher:geometry3k": ("geo", "geometry3k"),
    }
    assert "the default entry teacher_model (model_path=/t) is dropped" in caplog.text
