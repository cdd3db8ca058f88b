"""The RL prompt data: verl-format parquet, chat templates, batches, packing and balancing.

    tokenizer = jaxrl.data.load_tokenizer(model_path)
    train = jaxrl.data.RLDataset.from_config(cfg.data, tokenizer, split="train")
    batches = jaxrl.data.PromptIterator(train, cfg.data.train_batch_size, seed=1)
    batch = next(batches).repeat(cfg.actor_rollout_ref.rollout.n)   # PromptBatch, numpy
    state = batches.state_dict()                                    # into the checkpoint

For the trainer: `balance_batch` (equal work per data-parallel shard), `dynamic_micro_batches`
(micro-batches by token budget) and `pack` / `pack_padded` (rows with segment ids).
Preprocessing is a command: `python -m jaxrl.data.preprocess gsm8k|math|synthetic|... --help`.
"""

from jaxrl.data.balance import (
    balance_batch,
    calculate_workload,
    get_seqlen_balanced_partitions,
    greedy_partition,
    inverse_permutation,
    karmarkar_karp,
    seqlen_balance_metrics,
)
from jaxrl.data.batch import PromptBatch, bucket, group_ids_from_uids, repeated_group_ids
from jaxrl.data.dataset import RLDataset
from jaxrl.data.dynamic import dynamic_micro_batches, restore_order
from jaxrl.data.iterator import PromptIterator
from jaxrl.data.packing import (
    PackedRows,
    pack,
    pack_padded,
    pack_prompt_response,
    row_length,
    unpack,
    unpack_to_padded,
)
from jaxrl.data.rows import DataError, ReadReport, Row, read_rows, write_parquet
from jaxrl.data.templates import TRUNCATIONS, encode_prompts, left_pad, load_tokenizer, truncate

__all__ = [
    "TRUNCATIONS",
    "DataError",
    "PackedRows",
    "PromptBatch",
    "PromptIterator",
    "RLDataset",
    "ReadReport",
    "Row",
    "balance_batch",
    "bucket",
    "calculate_workload",
    "dynamic_micro_batches",
    "encode_prompts",
    "get_seqlen_balanced_partitions",
    "greedy_partition",
    "group_ids_from_uids",
    "inverse_permutation",
    "karmarkar_karp",
    "left_pad",
    "load_tokenizer",
    "pack",
    "pack_padded",
    "pack_prompt_response",
    "read_rows",
    "repeated_group_ids",
    "restore_order",
    "row_length",
    "seqlen_balance_metrics",
    "truncate",
    "unpack",
    "unpack_to_padded",
    "write_parquet",
]
