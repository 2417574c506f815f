"""Tokenizers: transformers' AutoTokenizer, with what it built kept on disk, as data, for the next start.

transformers 5 takes seconds to build some tokenizers: every added token is deep-copied into
`init_kwargs` (2-3 s for the bench model's 31,744), and some classes (Qwen2Tokenizer) rebuild the
backend from vocab and merges in Python. An entry `cache_root()/tokenizers/<digest>/` holds the backend's own
serialization (`tokenizer.json`, `tokenizers.Tokenizer.to_str()`) and `kvtide_tokenizer.json`: the
tokenizer class's name and its init arguments (special tokens, chat template, flags) as JSON. The
tokenizer is rebuilt from them with `cls(tokenizer_file=..., **arguments)`, which skips both
(SmolLM2 0.3 s instead of 0.7-1.0; the bench model 0.4-1.2 s instead of 2.7-3.2). The
digest covers the directory's path and every top-level file in it but the weights (so an edited
tokenizer_config.json or chat template is a new entry), and the transformers, tokenizers and Python
versions. Only local directories without remote code are cached; the newest `MAX_ENTRIES` are kept.

What an entry is trusted with: data, never code. Nothing is unpickled from it, and the only name it
gives is the class, which must be one of `CACHEABLE_CLASSES` (transformers' own fast tokenizers,
looked up as attributes of the transformers package); the arguments are JSON values (AddedTokens as their fields), and arguments
that name files or loading options are refused; the backend is parsed by the tokenizers library.
An entry is written only after the tokenizer rebuilt from it matched the one transformers built
(backend JSON, class, arguments, special and added tokens, chat template, encodings and decodings of
sample texts); a tokenizer it cannot represent is not cached. What a planted entry could still do
is what a planted tokenizer.json in the model directory could: change how text is tokenized and the
chat template (rendered in transformers' sandboxed Jinja). So the directory must be this user's
alone: cache_dir creates it 0700 and refuses one that another user can write to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from kvtide.models.cache_dir import build_cached_dir, cache_dir

logger = logging.getLogger(__name__)

MAX_ENTRIES = 8
_FORMAT = "2"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
BACKEND_FILE, META_FILE = "tokenizer.json", "kvtide_tokenizer.json"

CACHEABLE_CLASSES = frozenset({
    "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizer", "LlamaTokenizerFast",
    "CodeLlamaTokenizer", "CodeLlamaTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast",
    "GPT2Tokenizer", "GPT2TokenizerFast", "GPTNeoXTokenizer", "GPTNeoXTokenizerFast",
    "GemmaTokenizer", "GemmaTokenizerFast", "CohereTokenizer", "CohereTokenizerFast",
})
"""transformers' fast tokenizer classes of the model families kvtide serves; an entry naming any
other class is refused, and a tokenizer of another class is simply not cached."""

_NOT_STORED = frozenset({"name_or_path", "is_local", "local_files_only", "_commit_hash", "added_tokens_decoder"})
"""Init arguments left out of an entry: the path is the caller's, the loading flags say how it was
found, and added tokens are the backend's own (deep-copying them is what made the build slow)."""
_REFUSED = frozenset({"tokenizer_file", "tokenizer_object", "vocab_file", "merges_file", "gguf_file", "auto_map",
                      "trust_remote_code", "revision", "cache_dir", "token", "subfolder", "_from_auto",
                      "use_fast", "backend_class"})
"""Init arguments that would make the constructor read a file or load something: a tokenizer holding
one is not cached, and an entry naming one is refused."""

_PROBE_TEXTS = ("Hello world, this is a test.", "café 日本語 🙂", "  two  spaces\n\nand\tlines  ",
                "</s> <s> <|im_start|>user\nhi<|im_end|>", "<think>x</think> 12345 ```py\nprint(1)\n```")
_PROBE_MESSAGES = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}, {"role": "user", "content": "café?"})


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    """AutoTokenizer.from_pretrained(path), from the cache when `path` is a local directory seen before;
    a tokenizer that cannot be loaded is a ValueError naming the directory. A cache directory another
    user can write to is an UnsafeCacheDirError (cache_dir.py)."""
    from transformers import AutoTokenizer

    from kvtide.models.cache_dir import UnsafeCacheDirError

    def build():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)

    try:
        return _load_cached(path, build, trust_remote_code)
    except UnsafeCacheDirError:
        raise
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load a tokenizer from {path} ({reason}); pass --tokenizer DIR, a directory "
                         f"with tokenizer.json or tokenizer_config.json") from e


def _load_cached(path: str, build: Callable[[], Any], trust_remote_code: bool) -> Any:
    """The tokenizer `build()` makes for directory `path`, from the cache when an entry exists."""
    if trust_remote_code or not os.path.isdir(path):
        return build()
    try:
        entry = os.path.join(cache_dir("tokenizers"), _entry_name(path))
    except OSError as e:  # no cache to be had (a read-only home): build every time
        logger.debug("tokenizer cache unavailable (%s)", e)
        return build()
    if os.path.isdir(entry):
        try:
            tokenizer = _read_entry(entry, path)
            with contextlib.suppress(OSError):  # a read-only cache still serves its entries
                os.utime(entry)  # the newest entries are the ones kept
            return tokenizer
        except Exception as e:  # a truncated, foreign or planted entry: build again and replace it
            logger.warning("tokenizer cache entry %s unreadable (%s): building the tokenizer again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = build()
    _store(entry, path, tokenizer)
    return tokenizer


def _entry_name(path: str) -> str:
    import tokenizers
    import transformers

    digest = hashlib.blake2b(digest_size=16)
    # The path too: the tokenizer remembers it (name_or_path), so a copied directory is an entry of its own.
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
    return digest.hexdigest()


# ---- the entry: what it holds and how a tokenizer is rebuilt from it ------------------------------
def _describe(tokenizer: Any) -> dict:
    """kvtide_tokenizer.json's content for `tokenizer`; a ValueError where it cannot be represented."""
    name = type(tokenizer).__name__
    if name not in CACHEABLE_CLASSES or not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{name} is not a cacheable tokenizer class")
    refused = sorted(k for k, v in tokenizer.init_kwargs.items() if k in _REFUSED and v is not None)
    if refused:
        raise ValueError(f"init arguments {refused} name files or loading options")
    arguments = {k: _encode(v) for k, v in tokenizer.init_kwargs.items() if k not in _NOT_STORED | _REFUSED}
    return {"format": _FORMAT, "class": name, "arguments": arguments}


def _read_entry(entry: str, path: str) -> Any:
    """The tokenizer entry `entry` describes, rebuilt as data: a ValueError for anything it refuses."""
    import transformers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    with open(os.path.join(entry, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("arguments"), dict):
        raise ValueError("not a kvtide tokenizer entry")
    name = meta.get("class")
    if name not in CACHEABLE_CLASSES:
        raise ValueError(f"class {name!r} is not one kvtide caches")
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
        raise ValueError(f"class {name!r} is not a fast tokenizer of this transformers")
    arguments = meta["arguments"]
    if set(arguments) & (_NOT_STORED | _REFUSED):
        raise ValueError(f"arguments {sorted(set(arguments) & (_NOT_STORED | _REFUSED))} are not allowed")
    return cls(tokenizer_file=os.path.join(entry, BACKEND_FILE), name_or_path=path,
               **{k: _decode(v) for k, v in arguments.items()})


def _encode(value: Any) -> Any:
    """A JSON form of an init argument; a ValueError for a type the entry cannot hold. Containers are
    tagged so that decoding gives back the same types (a tuple would come back a list, so is refused)."""
    from tokenizers import AddedToken

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, AddedToken):
        return {"added_token": value.__getstate__()}
    if isinstance(value, list):
        return {"list": [_encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    raise ValueError(f"an init argument of type {type(value).__name__}")


_ADDED_TOKEN_FIELDS = frozenset({"content", "single_word", "lstrip", "rstrip", "normalized", "special"})


def _decode(value: Any) -> Any:
    from tokenizers import AddedToken

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "list" and isinstance(body, list):
            return [_decode(v) for v in body]
        if tag == "dict" and isinstance(body, dict):
            return {k: _decode(v) for k, v in body.items()}
        if tag == "added_token" and isinstance(body, dict) and set(body) <= _ADDED_TOKEN_FIELDS \
                and isinstance(body.get("content"), str) \
                and all(isinstance(body[k], bool) for k in body if k != "content"):
            return AddedToken(**body)
    raise ValueError(f"an argument kvtide does not write: {json.dumps(value)[:80]}")


def _mismatch(built: Any, rebuilt: Any) -> str | None:
    """Where the tokenizer rebuilt from an entry differs from the one transformers built (None: nowhere)."""
    def arguments(tokenizer: Any) -> str:
        return json.dumps({k: _encode(v) for k, v in tokenizer.init_kwargs.items()
                           if k not in _NOT_STORED | _REFUSED}, sort_keys=True)

    def token_table(tokenizer: Any) -> list:
        return sorted((i, repr(t)) for i, t in tokenizer.added_tokens_decoder.items())

    checks = {
        "class": lambda t: type(t),
        "backend": lambda t: t.backend_tokenizer.to_str(),
        "arguments": arguments,
        "added tokens": token_table,
        "special tokens": lambda t: (t.special_tokens_map, t.all_special_ids, t.bos_token_id, t.eos_token_id,
                                     t.pad_token_id, t.unk_token_id),
        "chat template": lambda t: t.chat_template,
        "settings": lambda t: tuple(getattr(t, a, None) for a in (
            "model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces",
            "split_special_tokens", "add_bos_token", "add_eos_token", "model_input_names")),
    }
    for what, read in checks.items():
        if read(built) != read(rebuilt):
            return what
    texts = list(_PROBE_TEXTS) + list(built.all_special_tokens)
    added = [t.content for _, t in sorted(built.added_tokens_decoder.items())]
    texts += added[:8] + added[-8:] + ["".join(added[:4]) + " x " + "".join(added[-4:])]
    if built.chat_template is not None:
        for generation in (False, True):
            try:
                texts.append(built.apply_chat_template(list(_PROBE_MESSAGES), tokenize=False,
                                                       add_generation_prompt=generation))
            except Exception:  # a template that refuses these messages: the texts above still probe
                continue
            if rebuilt.apply_chat_template(list(_PROBE_MESSAGES), tokenize=False,
                                           add_generation_prompt=generation) != texts[-1]:
                return "chat template rendering"
    for text in texts:
        for special in (True, False):
            ids = built(text, add_special_tokens=special).input_ids
            if rebuilt(text, add_special_tokens=special).input_ids != ids:
                return f"encoding of {text[:40]!r}"
            for skip in (False, True):
                if rebuilt.decode(ids, skip_special_tokens=skip) != built.decode(ids, skip_special_tokens=skip):
                    return f"decoding of {text[:40]!r}"
    return None


def _store(entry: str, path: str, tokenizer: Any) -> None:
    """Write `entry` whole (a reader never sees half of one) if the tokenizer rebuilt from it matches
    `tokenizer`, then drop the oldest beyond MAX_ENTRIES. A tokenizer it cannot represent is not cached."""
    def build(tmp: str) -> None:
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump(_describe(tokenizer), f)
        tokenizer.backend_tokenizer.save(os.path.join(tmp, BACKEND_FILE), pretty=False)
        differs = _mismatch(tokenizer, _read_entry(tmp, path))
        if differs:
            raise ValueError(f"the rebuilt tokenizer differs in its {differs}")

    try:
        build_cached_dir(entry, build)
    except Exception as e:
        logger.debug("tokenizer not cached (%s)", e)
        return
    directory = os.path.dirname(entry)
    names = os.listdir(directory)
    for stale in (n for n in names if n.endswith(".pkl")):  # the pickled entries of earlier versions
        _remove(os.path.join(directory, stale))
    entries = [os.path.join(directory, n) for n in names if len(n) == 32 and "." not in n]
    entries.sort(key=_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)


def _mtime(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:
        return 0.0


def _remove(file: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(file)
