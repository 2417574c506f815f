"""Tokenizers: transformers' AutoTokenizer, with the built object kept on disk for the next start.

transformers takes one to two seconds to build a large tokenizer (it deep-copies every vocabulary
entry and added token into `init_kwargs`, and some classes rebuild the backend from vocab and merges
in Python): a third of a warm start. The built object, pickled under
`cache_root()/tokenizers/<digest>.pkl`, loads in about 0.1 s. The digest covers the directory's path
and every top-level file in it but the weights (so an edited tokenizer_config.json or chat template
is a new entry), and the transformers, tokenizers and Python versions. Only local directories
without remote code are cached; the newest `MAX_ENTRIES` entries are kept. Entries are read back by
an unpickler that resolves tokenizer classes and nothing else, so a planted entry cannot name a
function to call (the directory is otherwise as trusted as the compiled kernels kvtide loads from it).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
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
        return _load_cached(path, build, trust_remote_code)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load a tokenizer from {path} ({reason}); pass --tokenizer DIR, a directory "
                         f"with tokenizer.json or tokenizer_config.json") from e


def _load_cached(path: str, build: Callable[[], Any], trust_remote_code: bool) -> Any:
    """The tokenizer `build()` makes for directory `path`, from the cache when an entry exists."""
    entry = _entry_path(path) if not trust_remote_code and os.path.isdir(path) else None
    if entry is None:
        return build()
    try:
        with open(entry, "rb") as f:
            tokenizer = _TokenizerUnpickler(f).load()
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
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
    # The path too: the object remembers it (name_or_path), so a copied directory is an entry of its own.
    for part in (_FORMAT, transformers.__version__, tokenizers.__version__, sys.version.split()[0],
                 os.path.realpath(path)):
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
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        _TokenizerUnpickler(io.BytesIO(data)).load()  # what the reader would refuse is not written
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, entry)
    except Exception as e:
        logger.debug("tokenizer not cached (%s)", e)
        _remove(tmp)
        return
    entries = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".pkl")]
    entries.sort(key=_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        _remove(old)


class _TokenizerUnpickler(pickle.Unpickler):
    """Resolves only what a built tokenizer holds: transformers' tokenizer classes, tokenizers' types
    and plain containers. An entry naming anything else (a function, another module) is refused
    before that module is even imported, so a planted file cannot run code through this reader."""

    _CONTAINERS = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
                   ("builtins", "complex"), ("builtins", "bytearray"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._CONTAINERS:
            return super().find_class(module, name)
        if module == "tokenizers" or module.startswith(("tokenizers.", "transformers.")):
            found = super().find_class(module, name)
            if isinstance(found, type) and (module.startswith("tokenizers") or _is_tokenizer_class(found)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tokenizer")


def _is_tokenizer_class(cls: type) -> bool:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return issubclass(cls, PreTrainedTokenizerBase)


def _mtime(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:
        return 0.0


def _remove(file: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(file)
