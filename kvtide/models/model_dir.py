"""Where a model's checkpoint lives on disk, whatever the user named: a directory, a GGUF file, a
built-in name or a Hugging Face hub id. Below EngineArgs and the speculative config's resolution,
which both turn a name into the directory the loader reads."""

from __future__ import annotations

import os

from kvtide.models.builtin import builtin_model_path


def resolve_model_dir(model: str, revision: str | None = None, tokenizer_override: bool = False) -> str:
    """A directory the loader reads: a checkpoint directory as it is, a hub id downloaded, a GGUF
    file (or a built-in name) turned into a cached directory whose weights stream from the file.
    `tokenizer_override`: another tokenizer is given, so a GGUF's own need not be exported."""
    # Imported here: it pulls in torch, which `kvtide serve` loads only in the engine core.
    from kvtide.models.gguf_checkpoint import is_gguf_file, prepare_gguf_model_dir

    path = builtin_model_path(model) or model
    if is_gguf_file(path):
        return prepare_gguf_model_dir(path, tokenizer_override=tokenizer_override)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        raise ValueError(f"model {path!r} is a file but not a GGUF (*.gguf) checkpoint; give a GGUF file, "
                         f"a checkpoint directory or a Hugging Face hub id")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:
        raise ValueError(f"model {model!r} is neither a local directory nor a reachable "
                         f"Hugging Face hub id ({type(e).__name__}: {e})") from e
