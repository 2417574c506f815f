"""Edits to a copied test checkpoint, shared by the suites that check how kvtide refuses one."""

from __future__ import annotations

import json
import os


def set_architecture(model_dir: str, architecture: str) -> None:
    """Rewrite config.json's `architectures` to [architecture] (e.g. one kvtide does not know)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    with open(path, "w") as f:
        json.dump(config, f)
