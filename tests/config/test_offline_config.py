"""The offline trainers' config trees (`jaxrl.config.offline`): verl's SFT names, TRL's DPO /
KTO names, and errors that name the key."""

import logging

import pytest

from jaxrl.config import ConfigError
from jaxrl.config.load import load_config
from jaxrl.config.offline import DPO, SFT, is_kto, loss_types

BASE = ["data.train_files=/data/train.parquet"]


def test_verl_sft_keys_land_on_jaxrl_keys(caplog):
    caplog.set_level(logging.INFO, "jaxrl.config")
    cfg = load_config(
        None,
        [*BASE, "model.partial_pretrain=/m", "optim.warmup_steps_ratio=0.2",
         "optim.lr_scheduler=constant", "data.messages_key=conv",
         "model.fsdp_config.wrap_policy.min_num_params=0", "ulysses_sequence_parallel_size=2",
         "model.use_liger=true", "data.multiturn.enable=true",
         "data.enable_thinking_default=false", "data.ignore_input_ids_mismatch=true"],
        num_devices=8, schema=SFT,
    )  # fmt: skip
    assert cfg.model.path == "/m"
    assert cfg.optim.lr_warmup_steps_ratio == 0.2 and cfg.optim.lr_scheduler_type == "constant"
    assert cfg.data.multiturn.messages_key == "conv" and cfg.data.multiturn.enable
    assert cfg.data.multiturn.enable_thinking_default is False
    assert cfg.data.multiturn.ignore_input_ids_mismatch
    assert cfg.mesh.sp == 2  # verl's Ulysses size is jaxrl's ring-attention axis
    assert cfg.data.train_files == ("/data/train.parquet",)
    assert "ignoring verl key model.use_liger" in caplog.text


def test_trl_keys_and_loss_terms():
    cfg = load_config(
        None,
        [*BASE, "model.path=/m", "dpo.loss_type=[sigmoid,ipo]", "dpo.loss_weights=[1,0.5]",
         "dpo.rpo_alpha=0.3", "dpo.precompute_ref_log_probs=true"],
        num_devices=1, schema=DPO,
    )  # fmt: skip
    assert loss_types(cfg) == (("sigmoid", "ipo", "sft"), (1.0, 0.5, 0.3))
    assert not is_kto(cfg)
    kto = load_config(None, [*BASE, "model.path=/m", "dpo.loss_type=kto"], schema=DPO)
    assert is_kto(kto)
    listed = load_config(None, [*BASE, "model.path=/m", "dpo.loss_type=[kto]"], schema=DPO)
    assert is_kto(listed) and listed.dpo.loss_type == "kto"
    assert cfg.optim.lr == 1e-6 and cfg.optim.lr_scheduler_type == "linear"  # TRL's defaults


@pytest.mark.parametrize(
    ("overrides", "schema", "message"),
    [
        (["model.path=/m", "dpo.loss_type=sigmod"], DPO, "dpo.loss_type: 'sigmod' is not one of"),
        (["model.path=/m", "dpo.loss_type=exo_pair"], DPO, "in (0, 1) for exo_pair"),
        (["model.path=/m", "dpo.loss_type=robust", "dpo.label_smoothing=0.6"], DPO,
         "[0, 0.5) for robust"),
        (["model.path=/m", "dpo.label_smoothing=0.1", "dpo.loss_type=hinge"], DPO,
         "has no effect on hinge"),
        (["model.path=/m", "dpo.loss_type=kto", "dpo.precompute_ref_log_probs=true"], DPO,
         "mismatched pairs"),
        (["model.path=/m", "dpo.loss_type=kto", "dpo.rpo_alpha=1"], DPO, "not to KTO"),
        (["model.path=/m", "dpo.loss_type=[robust,exo_pair]"], DPO, "in (0, 1) for exo_pair"),
        (["model.path=/m", "dpo.loss_type=kto", "dpo.truncation_mode=keep_end"], DPO,
         "dpo.truncation_mode='keep_end' with KTO"),
        (["model.path=/m", "dpo.loss_type=kto", "dpo.max_prompt_length=8"], DPO,
         "dpo.max_prompt_length=8 with KTO"),
        (["model.path=/m", "dpo.loss_type=kto", "data.train_batch_size=1"], DPO,
         "needs data.train_batch_size >= 2"),
        (["model.path=/m", "data.train_batch_size=12"], DPO,
         "data.train_batch_size (12) must be a multiple of the data-parallel shards"),
        (["model.path=/m", "dpo.f_divergence_type=js_divergence"], DPO,
         "dpo.f_divergence_type='js_divergence' is not supported"),
        (["model.path=/m", "data.truncation=middle"], SFT, "data.truncation: 'middle'"),
        (["model.path=/m", "data.promt_key=q"], SFT, "did you mean 'data.prompt_key'"),
        (["model.path=/m", "ulysses_sequence_parallel_size=2", "mesh.sp=4"], SFT, "disagree"),
        ([], SFT, "model.path is required"),
    ],
)  # fmt: skip
def test_errors_name_the_key(overrides, schema, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides], num_devices=8, schema=schema)
    assert message in str(e.value)


def test_demo_configs_load():
    for path, schema in (
        ("configs/sft_quickstart.yaml", SFT),
        ("configs/dpo_quickstart.yaml", DPO),
    ):
        load_config(path, num_devices=8, schema=schema)
