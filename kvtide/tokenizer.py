"""Tokenizers: transformers' AutoTokenizer, with the built object kept on disk for the next start.

transformers takes one to two seconds to build a large tokenizer (it deep-copies every vocabulary
entry and added token into `init_kwargs`, and some classes rebuild the backend from vocab and merges
in Python): a third of a warm start. The built object, pickled under
`cache_root()/tokenizers/<digest>.pkl`, loads in about 0.1 s. The digest covers every top-level file
of the directory but the weights (so an edited tokenizer_config.json or chat template is a new entry)
and the transformers, tokenizers and Python versions. Only local directories without remote code are
cached; the newest `MAX_ENTRIES` entries are kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from kvtide.models.cache_dir import cache_root

logger = logging.getLogger(__name__)

MAX_ENTRIES = 8
_FORMAT = "1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    """AutoTokenizer.from_pretrained(path), from the cache when `path` is a local directory seen before;
    a tokenizer that cannot be loaded is a ValueError naming the directory."""
    from transformers import AutoTokenizer

    def build():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)

    try:
        return load_cached_tokenizer(path, build, trust_remote_code)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load a tokenizer from {path} ({reason}); pass --tokenizer DIR, a directory "
                         f"with tokenizer.json or tokenizer_config.json") from e


def load_cached_tokenizer(path: str, build: Callable[[], Any], trust_remote_code: bool = False) -> Any:
    """The tokenizer `build()` makes for directory `path`, from the cache when an entry exists."""
    entry = _entry_path(path) if not trust_remote_code and os.path.isdir(path) else None
    if entry is None:
        return build()
    try:
        with open(entry, "rb") as f:
            tokenizer = pickle.load(f)
        os.utime(entry)  # the newest entries are the ones kept
        return tokenizer
    except FileNotFoundError:
        pass
    except Exception as e:  # a truncated or foreign file: build again and replace it
        logger.warning("tokenizer cache entry %s unreadable (%s): building the tokenizer again", entry, e)
    tokenizer = build()
    _store(entry, tokenizer)
    return tokenizer


def _entry_path(path: str) -> str:
    import tokenizers
    import transformers

    digest = hashlib.blake2b(digest_size=16)
    for part in (_FORMAT, transformers.__version__, tokenizers.__version__, sys.version.split()[0]):
        digest.update(part.encode() + b"\0")
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name.endswith(_WEIGHT_SUFFIXES) or not os.path.isfile(file):
            continue
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.blake2b(f.read()).digest())
    return os.path.join(cache_root(), "tokenizers", f"{digest.hexdigest()}.pkl")


def _store(entry: str, tokenizer: Any) -> None:
    """Write `entry` whole (a reader never sees half of one), then drop the oldest beyond MAX_ENTRIES.
    A tokenizer that cannot be pickled is simply not cached."""
    directory = os.path.dirname(entry)
    tmp = f"{entry}.tmp{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, entry)
    except Exception as e:
        logger.debug("tokenizer not cached (%s)", e)
        _remove(tmp)
        return
    entries = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".pkl")]
    entries.sort(key=_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        _remove(old)


def _mtime(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:
        return 0.0


def _remove(file: str) -> None:
    try:
        os.remove(file)
    except OSError:
        pass
