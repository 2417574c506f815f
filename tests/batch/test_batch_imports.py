"""kvtide/batch sits beside server/ (the server imports it): it may import what server/ may, plus
the cache directory helper, and nothing that runs models."""

from __future__ import annotations

import ast
import pathlib

import pytest

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")

BATCH = pathlib.Path(__file__).resolve().parents[2] / "kvtide" / "batch"
ALLOWED = ("kvtide.batch", "kvtide.engine", "kvtide.server", "kvtide.sampling_params", "kvtide.outputs",
           "kvtide.engine_args", "kvtide.config", "kvtide.sizes", "kvtide.models.cache_dir")


def test_batch_imports_no_model_code():
    offenders = []
    for path in BATCH.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            offenders += [f"{path.name}: {n}" for n in names
                          if n == "torch" or n.startswith("kvtide") and not n.startswith(ALLOWED)]
    assert offenders == []
