"""House rules that code review alone would let slip."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parent.parent / "kvtide"
DEVICE_PACKAGES = ("kvtide.worker", "kvtide.models", "kvtide.layers", "kvtide.attention")
PURE_SPEC_DECODE = ("kvtide.spec_decode.config", "kvtide.spec_decode.policy", "kvtide.spec_decode.metrics")
"""The speculative-decoding modules policy code may use: plain Python (the rest of the package runs models)."""
PURE_POOLING = ("kvtide.pooling.params", "kvtide.pooling.outputs", "kvtide.pooling.config", "kvtide.pooling.scoring")
"""The pooling modules the engine and the server use: plain Python, the public pooling types."""


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_policy_packages_import_no_device_code():
    offenders = []
    for package in ("engine", "scheduler", "kv_cache"):
        for path in (PKG / package).rglob("*.py"):
            offenders += [f"{path.relative_to(PKG)}: {name}" for name in _imports(path)
                          if name.startswith(DEVICE_PACKAGES)
                          or name.startswith("kvtide.spec_decode") and name not in PURE_SPEC_DECODE]
    assert offenders == []


def test_pure_spec_decode_modules_import_no_torch():
    for name in PURE_SPEC_DECODE:
        path = PKG / (name.removeprefix("kvtide.").replace(".", "/") + ".py")
        imports = _imports(path)
        assert not [i for i in imports if i == "torch" or i.startswith(("torch.", *DEVICE_PACKAGES))], name
        assert all(i in PURE_SPEC_DECODE for i in imports if i.startswith("kvtide.")), name


def test_pure_pooling_modules_import_no_torch():
    for name in PURE_POOLING:
        imports = _imports(PKG / (name.removeprefix("kvtide.").replace(".", "/") + ".py"))
        assert not [i for i in imports if i == "torch" or i.startswith(("torch.", *DEVICE_PACKAGES))], name
        assert all(i in PURE_POOLING for i in imports if i.startswith("kvtide.")), name


def test_server_imports_only_engine_and_public_types():
    allowed = ("kvtide.engine", "kvtide.server", "kvtide.sampling_params", "kvtide.outputs", *PURE_POOLING,
               "kvtide.engine_args", "kvtide.config", "kvtide.bootstrap", "kvtide.spec_decode.metrics",
               "kvtide.tool_parsers", "kvtide.reasoning", "kvtide.sizes", "kvtide.net_auth",
               "kvtide.batch")
    offenders = []
    server = PKG / "server"
    for path in server.rglob("*.py") if server.exists() else []:
        offenders += [f"{path.relative_to(PKG)}: {name}" for name in _imports(path)
                      if name.startswith("kvtide") and not name.startswith(allowed) and name != "kvtide"]
    assert offenders == []


def test_server_front_end_starts_its_engine_core_before_importing_torch():
    # `kvtide serve` parses and checks its flags and spawns the engine core before it imports its
    # web stack; torch (1-1.5 s to import) then loads in the engine core only, beside that.
    probe = ("import sys\n"
             "from kvtide.cli import build_parser\n"
             "args = build_parser('serve').parse_args(['serve', 'demo', '--max-request-body', '1MiB'])\n"
             "from kvtide.engine_args import EngineArgs\n"
             "from kvtide.engine.core_client import spawn_engine_core\n"
             "EngineArgs.from_cli_args(args)\n"
             "heavy = ('torch', 'transformers', 'numpy', 'fastapi')\n"
             "print(sorted(m for m in heavy if m in sys.modules))\n"
             "import kvtide.server.api_server, kvtide.server.state\n"
             "print(sorted(m for m in heavy if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "['fastapi']"]


def test_no_pickle_on_any_channel():
    forbidden = ("pickle.loads", "pickle.load(", "recv_pyobj", "send_pyobj", "cloudpickle")
    hits = [f"{p.relative_to(PKG)}: {word}" for p in PKG.rglob("*.py") for word in forbidden
            if word in p.read_text()]
    assert hits == []


def test_ruff_is_clean():
    import subprocess
    import sys

    root = PKG.parent
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "kvtide", "tests"], cwd=root,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
