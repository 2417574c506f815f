"""Assemble an engine from EngineArgs: config, tokenizer, executor (model + KV cache), core.

Lives outside engine/ because it is where the policy side meets the device side; both the
offline LLM and the server's engine-core process start here.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from kvtide.config import EngineConfig
from kvtide.engine.core import EngineCore
from kvtide.engine_args import CPU_DEFAULT_KV_CACHE_MEMORY, EngineArgs

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What the API side needs to know about the model, without loading it."""

    model_dir: str
    tokenizer_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load a tokenizer from {path} ({reason}); pass --tokenizer DIR, a directory "
                         f"with tokenizer.json or tokenizer_config.json") from e


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (may list several), else config, else tokenizer."""
    ids = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    cache = config.cache_config
    if cache.kv_cache_memory is not None:
        memory = cache.kv_cache_memory
    elif config.device_config.device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free
        memory = int(total * cache.gpu_memory_utilization) - used_by_others
    else:
        # No more than the scheduler could ever fill.
        tokens = config.scheduler_config.max_num_seqs * config.model_config.max_model_len
        memory = min(CPU_DEFAULT_KV_CACHE_MEMORY, tokens // cache.block_size * bytes_per_block + bytes_per_block)
    num_blocks = memory // bytes_per_block
    max_model_len = config.model_config.max_model_len
    if num_blocks * cache.block_size < max_model_len:
        need = -(-max_model_len // cache.block_size) * bytes_per_block
        raise ValueError(f"the KV cache holds {num_blocks * cache.block_size} tokens, fewer than "
                         f"max_model_len={max_model_len}; give kv_cache_memory >= {need} bytes or lower "
                         f"max_model_len")
    return num_blocks


def build_engine_core(args: EngineArgs) -> tuple[EngineCore, ModelInfo]:
    from kvtide.worker.executor import UniprocExecutor

    model_dir = args.resolve_model_dir()
    config = args.create_engine_config(model_dir)
    executor = UniprocExecutor(config, model_dir)
    num_blocks = _num_kv_blocks(config, executor.kv_bytes_per_block())
    executor.initialize_kv_cache(num_blocks)
    config = config.replace_cache(num_blocks=num_blocks)
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.cache_config.block_size,
                num_blocks * executor.kv_bytes_per_block() / 2**20)
    info = model_info(args, model_dir, config)
    return EngineCore(config, executor), info


def model_info(args: EngineArgs, model_dir: str, config: EngineConfig | None = None) -> ModelInfo:
    if config is None:
        config = args.create_engine_config(model_dir)
    tokenizer_dir = args.tokenizer or model_dir
    tokenizer = load_tokenizer(tokenizer_dir, args.trust_remote_code)
    hf_config = config.model_config.hf_config
    return ModelInfo(model_dir, tokenizer_dir, hf_config.vocab_size, config.model_config.max_model_len,
                     eos_token_ids(model_dir, hf_config, tokenizer))
