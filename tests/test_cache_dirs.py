"""$KVTIDE_CACHE is this user's alone: kvtide creates its directories 0700, and refuses to read from
(or write to) one that another user could write to, before any tokenizer, checkpoint or compiled
library is taken from it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtide.attention import cpu_extension
from kvtide.models.cache_dir import UnsafeCacheDirError, cache_dir, check_triton_cache
from kvtide.tokenizer import load_tokenizer


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "home" / ".cache" / "kvtide"  # nothing of it exists yet
    monkeypatch.setenv("KVTIDE_CACHE", str(root))
    return root


@pytest.fixture
def loose_umask():
    """A umask that would make every new directory group-writable: kvtide's modes must not follow it."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_a_fresh_cache_is_created_0700(cache, llama_dir, loose_umask):
    load_tokenizer(llama_dir)
    (entry,) = os.listdir(cache / "tokenizers")
    for directory in (cache, cache / "tokenizers", cache / "tokenizers" / entry, Path(cache_dir("gemm"))):
        assert _mode(directory) == 0o700, directory


def test_a_compiled_kernel_build_directory_is_created_0700(cache, tmp_path, loose_umask):
    source = tmp_path / "broken_op.cpp"
    source.write_text("this is not C++\n")  # the compiler fails at once: only the directory is looked at
    assert cpu_extension.load_cpu_op(source, "kvtide_test", "op", "a test op", "default") is None
    build = cpu_extension.build_directory("default", source)
    assert build.is_dir() and build.parent == cache / "torch_ext"
    assert _mode(build) == _mode(build.parent) == _mode(cache) == 0o700


@pytest.mark.parametrize("where", ["root", "tokenizers"])
def test_a_group_writable_cache_is_refused(where, cache, llama_dir):
    load_tokenizer(llama_dir)  # a cache that was fine, then loosened
    loose = cache if where == "root" else cache / "tokenizers"
    os.chmod(loose, 0o775)
    with pytest.raises(UnsafeCacheDirError) as refused:
        load_tokenizer(llama_dir)
    message = str(refused.value)
    assert str(loose) in message and "mode 0775" in message and "writable by its group" in message
    assert f"chmod 700 {loose}" in message and "KVTIDE_CACHE" in message


def test_a_world_writable_kernel_cache_is_refused_before_anything_is_built(cache, tmp_path):
    source = tmp_path / "never_built.cpp"
    source.write_text("this is not C++\n")
    os.makedirs(cache / "torch_ext")
    os.chmod(cache / "torch_ext", 0o777)
    with pytest.raises(UnsafeCacheDirError, match="writable by its group and every user"):
        cpu_extension.load_cpu_op(source, "kvtide_test2", "op", "a test op", "default")
    assert os.listdir(cache / "torch_ext") == []


def test_a_gguf_cache_of_another_writer_is_refused(cache, smollm2_gguf):
    from kvtide.models.gguf_checkpoint import prepare_gguf_model_dir

    os.makedirs(cache / "gguf")
    os.chmod(cache / "gguf", 0o770)
    with pytest.raises(UnsafeCacheDirError, match="gguf"):
        prepare_gguf_model_dir(smollm2_gguf)


def test_a_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch, llama_dir):
    if os.geteuid() == 0:  # root refuses a user's directory too: that user could plant what root loads
        other = tmp_path / "someone-elses"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
    else:
        other = Path("/usr")  # root's, 0755: not writable by us, but not ours either
    monkeypatch.setenv("KVTIDE_CACHE", str(other))
    with pytest.raises(UnsafeCacheDirError, match=f"refusing the cache directory {other} .*owned by"):
        load_tokenizer(llama_dir)


def test_tritons_kernel_cache_is_held_to_the_same_rule(tmp_path, monkeypatch, loose_umask):
    """The CUDA model runner calls check_triton_cache before any Triton kernel is compiled or loaded."""
    fresh = tmp_path / "triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert check_triton_cache() == str(fresh) and _mode(fresh) == 0o700
    os.chmod(fresh, 0o777)
    with pytest.raises(UnsafeCacheDirError, match=f"{fresh} \\(mode 0777"):
        check_triton_cache()
