"""load_tokenizer's on-disk cache: the second start takes the built tokenizer from
$KVTIDE_CACHE/tokenizers, and it behaves as the one transformers builds."""

from __future__ import annotations

import os
import shutil

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
    return sorted(os.listdir(cache)) if cache.exists() else []


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


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_second_load_comes_from_the_cache_and_behaves_the_same(model, cache, monkeypatch, llama_dir):
    if model == "smollm2":  # the real model's BPE tokenizer, as the GGUF's prepared directory holds it
        from kvtide.engine_args import EngineArgs

        directory = EngineArgs(model="smollm2").resolve_model_dir()
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
    (cache / entry).write_bytes(b"not a pickle")
    with caplog.at_level("WARNING", logger="kvtide.tokenizer"):
        rebuilt = load_tokenizer(directory)
    assert "unreadable" in caplog.text
    _assert_same(rebuilt, reference)
    assert (cache / entry).read_bytes() != b"not a pickle"
    assert _entries(cache) == [entry]  # no temporary file left behind


class _Planted:
    """An entry that, unpickled by a plain pickle.load, would write a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_entry_runs_nothing_and_is_replaced(cache, copy_of, tmp_path, caplog):
    import pickle

    directory = copy_of()
    reference = load_tokenizer(directory)
    (entry,) = _entries(cache)
    marker = tmp_path / "ran"
    (cache / entry).write_bytes(pickle.dumps(_Planted(str(marker))))
    with caplog.at_level("WARNING", logger="kvtide.tokenizer"):
        loaded = load_tokenizer(directory)
    assert not marker.exists()
    assert "is not part of a tokenizer" in caplog.text
    _assert_same(loaded, reference)


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
