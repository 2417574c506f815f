"""Security controls (issue 7, item 6): the API key on every route but /health, compared in
constant time; each request limit at its value and one past it; no pickle anywhere; a checkpoint's
custom code never runs without trust_remote_code; internal sockets on loopback or Unix only."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import httpx
import pytest
from rel_helpers import API_KEY, MAX_REQUEST_BODY, MODEL_NAME, check_error_body, start, wait_for

from kvtide.server import limits

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PKG = pathlib.Path(__file__).resolve().parents[2] / "kvtide"


# ---- the API key ---------------------------------------------------------------------------------
def _routes(server) -> list[tuple[str, str]]:
    spec = httpx.get(server.url("/openapi.json"), headers=server.headers, timeout=30).json()
    routes = [(method.upper(), path) for path, ops in spec["paths"].items() for method in ops]
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer " + API_KEY[:-1] + "X"},
                                     {"Authorization": "Bearer " + API_KEY + "4"}, {"X-Api-Key": "nope"},
                                     {"Authorization": "bearer"}],
                         ids=["none", "last char wrong", "one char more", "x-api-key wrong", "scheme only"])
def test_api_key_guards_every_route_but_health(fuzz_server, headers):
    routes = _routes(fuzz_server)
    assert ("GET", "/health") in routes and len(routes) > 10
    for method, path in routes:
        r = httpx.request(method, fuzz_server.url(path), headers=headers, json={}, timeout=30)
        if path == "/health":
            assert r.status_code == 200
        else:
            assert r.status_code == 401, (method, path, r.status_code)
            assert check_error_body(r.json())["code"] == "invalid_api_key"


def test_api_key_accepted_both_ways(fuzz_server):
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"X-Api-Key": API_KEY}):
        assert httpx.get(fuzz_server.url("/v1/models"), headers=headers, timeout=30).status_code == 200


def test_api_key_compared_in_constant_time(monkeypatch):
    """The comparison is hmac.compare_digest's (a timing test would be flaky; this says which code
    decides)."""
    import hmac

    from kvtide.server import middleware

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(middleware.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert middleware._authorized({"authorization": b"Bearer k1"}, "k1")
    assert not middleware._authorized({"authorization": b"Bearer k2"}, "k1")
    assert not middleware._authorized({}, "k1")
    assert len(calls) == 3
    source = pathlib.Path(middleware.__file__).read_text()
    assert "==" not in source.split("def _authorized", 1)[1].split("def ", 1)[0]


# ---- limits: at the limit, and one past ----------------------------------------------------------
def _cmpl(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "limits", "max_tokens": 1, **fields}


LIMITS = [
    # (name, path, body at the limit, body one past, param)
    ("n", CMPL, _cmpl(n=limits.MAX_N), _cmpl(n=limits.MAX_N + 1), "n"),
    ("best_of", CMPL, _cmpl(n=limits.MAX_BEST_OF, best_of=limits.MAX_BEST_OF),
     _cmpl(n=limits.MAX_N, best_of=limits.MAX_BEST_OF + 1), "best_of"),
    ("logprobs", CMPL, _cmpl(logprobs=limits.MAX_TOP_LOGPROBS), _cmpl(logprobs=limits.MAX_TOP_LOGPROBS + 1),
     "logprobs"),
    ("top_logprobs", CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                            "logprobs": True, "top_logprobs": limits.MAX_TOP_LOGPROBS},
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
      "top_logprobs": limits.MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ("stop strings", CMPL, _cmpl(stop=[f"<{i}>" for i in range(limits.MAX_STOP_STRINGS)]),
     _cmpl(stop=[f"<{i}>" for i in range(limits.MAX_STOP_STRINGS + 1)]), "stop"),
    ("stop string length", CMPL, _cmpl(stop=["s" * limits.MAX_STOP_STRING_CHARS]),
     _cmpl(stop=["s" * (limits.MAX_STOP_STRING_CHARS + 1)]), "stop"),
    ("stop_token_ids", CMPL, _cmpl(stop_token_ids=[7] * limits.MAX_STOP_TOKEN_IDS),
     _cmpl(stop_token_ids=[7] * (limits.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ("logit_bias", CMPL, _cmpl(logit_bias={str(i): 0.5 for i in range(limits.MAX_LOGIT_BIAS)}),
     _cmpl(logit_bias={str(i): 0.5 for i in range(limits.MAX_LOGIT_BIAS + 1)}), "logit_bias"),
]


@pytest.mark.parametrize("name,path,at_limit,past_limit,param", LIMITS, ids=[c[0] for c in LIMITS])
def test_request_limits(fuzz_server, name, path, at_limit, past_limit, param):
    with fuzz_server.client(timeout=120) as client:
        r = client.post(path, json=at_limit)
        assert r.status_code == 200, r.text
        r = client.post(path, json=past_limit)
        assert r.status_code == 400, r.text
        assert check_error_body(r.json())["param"] == param


def _exact_body(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (the prompt padded with JSON whitespace)."""
    body = json.dumps(_cmpl(prompt="x")).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_body_size_limit(fuzz_server):
    with fuzz_server.client() as client:
        for size, status in ((MAX_REQUEST_BODY, 200), (MAX_REQUEST_BODY + 1, 413)):
            body = _exact_body(size)
            assert len(body) == size
            r = client.post(CMPL, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, r.text


def test_header_size_limit(fuzz_server):
    with httpx.Client(base_url=fuzz_server.base_url, headers=fuzz_server.headers, timeout=30) as client:
        for extra, status in ((0, 200), (1, 431)):
            request = client.build_request("POST", CMPL, json=_cmpl(), headers={"X-Pad": ""})
            size = sum(len(k) + len(v) for k, v in request.headers.raw)
            pad = limits.MAX_HEADER_BYTES - size + extra
            request = client.build_request("POST", CMPL, json=_cmpl(), headers={"X-Pad": "p" * pad})
            assert sum(len(k) + len(v) for k, v in request.headers.raw) == limits.MAX_HEADER_BYTES + extra
            r = client.send(request)
            assert r.status_code == status, r.text
            if status != 200:
                assert check_error_body(r.json())["code"] == "headers_too_large"


def test_limits_are_in_serve_help():
    from kvtide.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    text = " ".join(serve.format_help().split())
    assert " ".join(limits.describe().split()) in text
    for value in (limits.MAX_N, limits.MAX_LOGIT_BIAS, limits.MAX_STOP_STRINGS, limits.MAX_HEADER_BYTES):
        assert str(value) in text
    assert "--engine-timeout" in text


# ---- no pickle -----------------------------------------------------------------------------------
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
"""No exception: the tokenizer cache too keeps data (JSON), never pickles (test_tokenizer_cache.py plants
a pickle that ran code through the restricted unpickler it once had)."""


def test_no_pickle_on_any_channel():
    """Beyond tests/test_import_rules.py's grep: no module that unpickles is imported at all (the
    tokenizer cache included), no pyobj socket calls, and every torch.load says weights_only=True."""
    offenders = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            offenders += [f"{path.relative_to(PKG)}: import {n}" for n in names if n in FORBIDDEN_MODULES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                if attr in ("recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"):
                    offenders.append(f"{path.relative_to(PKG)}: {attr}")
                if attr == "load" and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    ok = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                             for k in node.keywords)
                    if not ok:
                        offenders.append(f"{path.relative_to(PKG)}: torch.load without weights_only=True")
    assert offenders == []


# ---- trust_remote_code ---------------------------------------------------------------------------
_EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("executed")
raise SystemExit("custom code ran")
"""


def _remote_code_checkpoint(llama_dir: str, root: pathlib.Path, name: str, model_type: str) -> tuple[str, str]:
    """A copy of the checkpoint whose config.json (and tokenizer_config.json) point at custom .py
    files that, if imported, write a marker file."""
    model = root / name
    shutil.copytree(llama_dir, model)
    marker = str(root / f"{name}.executed")
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (model / f"{module}.py").write_text(_EVIL.format(marker=marker))
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return str(model), marker


@pytest.fixture(scope="module")
def remote_code_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_code")
    return {"known type": _remote_code_checkpoint(llama_dir, root, "known", "llama"),
            "custom type": _remote_code_checkpoint(llama_dir, root, "custom", "evil_model")}


def test_remote_code_never_runs_offline(remote_code_dirs):
    from kvtide import LLM, SamplingParams

    model, marker = remote_code_dirs["known type"]
    llm = LLM(model, max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=2)
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs
    model, custom_marker = remote_code_dirs["custom type"]
    with pytest.raises(ValueError):
        LLM(model, max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=2)
    assert not os.path.exists(marker) and not os.path.exists(custom_marker)


def test_remote_code_never_runs_in_serve(remote_code_dirs):
    (known, known_marker), (custom, custom_marker) = remote_code_dirs["known type"], remote_code_dirs["custom type"]
    failing = subprocess.Popen([sys.executable, "-m", "kvtide.cli", "serve", custom, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    server = start(known, "--max-model-len", "128", "--max-num-seqs", "2")
    try:
        from rel_helpers import wait_ready

        wait_ready(server)
        r = httpx.post(server.url(CMPL), headers=server.headers, json=_cmpl(), timeout=60)
        assert r.status_code == 200
        output, _ = failing.communicate(timeout=120)
        assert failing.returncode not in (0, None)
        assert "Traceback" not in output and output.strip().splitlines()[-1].startswith("kvtide serve: error:")
        assert "trust" in output.strip().splitlines()[-1].lower() or "evil_model" in output, output[-2000:]
    finally:
        server.stop()
        os.unlink(server.log_path)
        if failing.poll() is None:
            failing.kill()
            failing.wait()
    assert not os.path.exists(known_marker) and not os.path.exists(custom_marker)


# ---- internal sockets ----------------------------------------------------------------------------
def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of the LISTEN TCP sockets `pid` holds (IPv4 and IPv6)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and inode in inodes:
                    address, port = local.split(":")
                    found.append((address, int(port, 16)))
    return found


def _unix_paths(pid: int) -> list[str]:
    inodes = _socket_inodes(pid)
    paths = []
    with open(f"/proc/{pid}/net/unix") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if len(fields) >= 8 and int(fields[6]) in inodes:
                paths.append(fields[7])
    return paths


def test_internal_sockets_are_loopback_or_unix(fuzz_server):
    """The engine core listens on nothing; the API process listens only on its HTTP port (the
    --host given, 127.0.0.1 by default); API <-> engine runs over ipc:// (Unix) sockets in a
    directory only their owner may enter."""
    from kvtide.engine import core_client

    source = pathlib.Path(core_client.__file__).read_text()
    assert "tcp://" not in source and "ipc://" in source
    api_pid, engine_pid = fuzz_server.proc.pid, fuzz_server.engine_pid
    assert _tcp_listeners(engine_pid) == []
    assert _tcp_listeners(api_pid) == [("0100007F", fuzz_server.port)]  # 127.0.0.1, little-endian hex
    ipc = {p for p in _unix_paths(api_pid)  # listening + accepted: one path
           if os.path.basename(os.path.dirname(p)).startswith("kvtide-engine-")}
    assert len(ipc) == 2, _unix_paths(api_pid)
    for path in ipc:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and not mode & stat.S_IWOTH, (path, oct(mode))
        folder = os.stat(os.path.dirname(path))
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid(), oct(folder.st_mode)
    wait_for(lambda: httpx.get(fuzz_server.url("/health")).status_code == 200, 10, "health")
