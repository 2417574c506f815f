"""load_tokenizer's on-disk cache: the second start rebuilds the tokenizer from the data kept in
$KVTIDE_CACHE/tokenizers (backend JSON, class name, init arguments), and it behaves as the one
transformers builds; an entry that is anything else (a pickle that once ran code) runs nothing."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct

import pytest
import transformers

from kvtide import tokenizer as tokenizer_module
from kvtide.tokenizer import load_tokenizer

TEXTS = ["Hello world, this is a test.", "café 日本語 🙂", "  two  spaces\n\nand lines", "</s> <s> inside text"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVTIDE_CACHE", str(root))
    return root / "tokenizers"


@pytest.fixture
def copy_of(tmp_path, llama_dir):
    """A tokenizer directory of the tiny Llama's files (weights left out) that a test may edit."""
    def make(name: str = "tok") -> str:
        target = tmp_path / name
        target.mkdir()
        for file in os.listdir(llama_dir):
            if not file.endswith(".safetensors"):
                shutil.copy(os.path.join(llama_dir, file), target / file)
        return str(target)
    return make


def _entries(cache) -> list[str]:
    return sorted(n for n in os.listdir(cache) if not n.endswith(".pkl")) if cache.exists() else []


def _refuse_to_build(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to build the tokenizer again")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def _assert_same(a, b):
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids
        assert a.decode(a(text).input_ids) == b.decode(b(text).input_ids)
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (b.eos_token_id, b.bos_token_id, b.pad_token_id)
    assert a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("model", ["tiny", "qwen2-class", "smollm2"])
def test_the_second_load_comes_from_the_cache_and_behaves_the_same(model, cache, monkeypatch, llama_dir, copy_of):
    if model == "smollm2":  # the real model's BPE tokenizer, as the GGUF's prepared directory holds it
        from kvtide.engine_args import EngineArgs

        directory = EngineArgs(model="smollm2").resolve_model_dir()
    elif model == "qwen2-class":  # a class with an __init__ of its own (it builds from vocab and merges)
        directory = copy_of()
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({**config, "tokenizer_class": "Qwen2Tokenizer"}, f)
    else:
        directory = llama_dir
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    first = load_tokenizer(directory)
    assert len(_entries(cache)) == 1
    _refuse_to_build(monkeypatch)
    second = load_tokenizer(directory)
    assert type(second) is type(reference)
    _assert_same(second, reference)
    _assert_same(first, reference)


def test_an_edited_chat_template_is_a_new_entry(cache, copy_of):
    directory = copy_of()
    before = load_tokenizer(directory)
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    after = load_tokenizer(directory)
    assert len(_entries(cache)) == 2
    messages = [{"role": "user", "content": "hi"}]
    assert after.apply_chat_template(messages, tokenize=False) == "<<hi>>"
    assert before.apply_chat_template(messages, tokenize=False) != "<<hi>>"


def test_an_unreadable_entry_is_built_again_and_replaced(cache, copy_of, caplog):
    directory = copy_of()
    reference = load_tokenizer(directory)
    (entry,) = _entries(cache)
    meta = cache / entry / tokenizer_module.META_FILE
    meta.write_bytes(b"not json")
    with caplog.at_level("WARNING", logger="kvtide.tokenizer"):
        rebuilt = load_tokenizer(directory)
    assert "unreadable" in caplog.text
    _assert_same(rebuilt, reference)
    assert json.loads(meta.read_text())["class"] == type(reference).__name__
    assert _entries(cache) == [entry]  # no temporary directory left behind


def _bypass_payload(marker: str) -> bytes:
    """A pickle that runs `touch marker` through names a 'tokenizers*'-only find_class resolved: the
    chain tokenizers.implementations...BaseTokenizer.__init__ reaches FunctionType and CodeType (both
    types, both "in" tokenizers), so it builds a function from bytecode of its own and calls it."""
    def body():
        __import__("os").system("COMMAND")

    code = body.__code__
    constants = tuple(f"touch {marker}" if c == "COMMAND" else c for c in code.co_consts)
    arguments = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_nlocals,
                 code.co_stacksize, code.co_flags, code.co_code, constants, code.co_names, code.co_varnames,
                 code.co_filename, code.co_name, code.co_qualname, code.co_firstlineno, code.co_linetable,
                 code.co_exceptiontable, code.co_freevars, code.co_cellvars)

    def text(value: str) -> bytes:
        return b"\x8c" + struct.pack("<B", len(value)) + value.encode()

    init = "implementations.base_tokenizer.BaseTokenizer.__init__"
    return (b"\x80\x04" + text("tokenizers") + text(init + ".__class__") + b"\x93"  # FunctionType
            + text("tokenizers") + text(init + ".__code__.__class__") + b"\x93"  # CodeType
            + pickle.dumps(arguments, protocol=3)[2:-1] + b"R"  # CodeType(*arguments)
            + b"}\x86R" + b")R.")  # FunctionType(code, {})()


class _OldReader(pickle.Unpickler):
    """The reader kvtide had: tokenizers' types, transformers' tokenizer classes, a few containers."""

    def find_class(self, module: str, name: str):
        if module == "tokenizers" or module.startswith("tokenizers."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tokenizer")


def test_a_planted_entry_runs_nothing_and_is_replaced(cache, copy_of, tmp_path, caplog):
    payload_works = tmp_path / "payload-works"
    _OldReader(io.BytesIO(_bypass_payload(str(payload_works)))).load()
    assert payload_works.exists()  # the file is a live exploit for a restricted unpickler

    directory = copy_of()
    reference = load_tokenizer(directory)
    marker = tmp_path / "ran"
    for file in [f for f in cache.rglob("*") if f.is_file()]:  # whatever the entry's files are, and a pickle
        file.write_bytes(_bypass_payload(str(marker)))
        file.with_name(file.name + ".pkl").write_bytes(_bypass_payload(str(marker)))
    with caplog.at_level("WARNING", logger="kvtide.tokenizer"):
        loaded = load_tokenizer(directory)
    assert not marker.exists()
    assert "unreadable" in caplog.text
    _assert_same(loaded, reference)
    (entry,) = _entries(cache)
    assert json.loads((cache / entry / tokenizer_module.META_FILE).read_text())["format"] == tokenizer_module._FORMAT


@pytest.mark.parametrize("meta", [{"class": "Pipeline"}, {"class": "os.system"},
                                  {"arguments": {"tokenizer_file": "/etc/passwd"}},
                                  {"arguments": {"bos_token": {"__reduce__": "os.system"}}}])
def test_an_entry_naming_another_class_or_a_file_is_refused(meta, cache, copy_of, caplog):
    directory = copy_of()
    reference = load_tokenizer(directory)
    (entry,) = _entries(cache)
    file = cache / entry / tokenizer_module.META_FILE
    planted = json.loads(file.read_text())
    planted.update(meta)
    file.write_text(json.dumps(planted))
    with caplog.at_level("WARNING", logger="kvtide.tokenizer"):
        loaded = load_tokenizer(directory)
    assert "unreadable" in caplog.text
    _assert_same(loaded, reference)


def test_a_class_outside_the_allow_list_is_not_cached(cache, copy_of):
    directory = copy_of()
    config = os.path.join(directory, "tokenizer_config.json")
    with open(config) as f:
        content = json.load(f)
    with open(config, "w") as f:
        json.dump({**content, "tokenizer_class": "RobertaTokenizer"}, f)
    tokenizer = load_tokenizer(directory)
    assert type(tokenizer).__name__ == "RobertaTokenizer"
    assert _entries(cache) == []


def test_the_cache_keeps_only_the_newest_entries(cache, copy_of, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "MAX_ENTRIES", 2)
    directories = [copy_of(f"tok{i}") for i in range(3)]
    for i, directory in enumerate(directories):  # three distinct directories: a config field differs
        with open(os.path.join(directory, "generation_config.json"), "a") as f:
            f.write(" " * (i + 1))
    stamps = []
    for directory in directories:
        load_tokenizer(directory)
        stamps.append(set(_entries(cache)))
    assert len(stamps[-1]) == 2
    assert not (stamps[0] & stamps[-1])  # the oldest went first


def test_remote_code_and_missing_directories_are_not_cached(cache, copy_of):
    load_tokenizer(copy_of(), trust_remote_code=True)
    assert _entries(cache) == []
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(cache.parent / "no-such-directory"))
    assert _entries(cache) == []
