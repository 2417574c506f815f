"""Checkpoints shared by the distributed suites."""

from __future__ import annotations

import os
import re

import pytest
from safetensors.torch import load_file, save_file

from kvtide.models.demo import make_random_checkpoint


@pytest.fixture(scope="session")
def looping_dir(tmp_path_factory) -> str:
    """Seed 3's tiny Llama with the attention output of layers 0-2 zeroed (layer 3 attends): greedy
    decoding falls into short loops, which the n-gram proposer predicts."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("looping-llama")), seed=3)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        match = re.search(r"layers\.(\d+)\.self_attn\.o_proj\.weight", name)
        if match and int(match.group(1)) < 3:
            tensors[name] = tensors[name] * 0.0
    save_file(tensors, file, metadata={"format": "pt"})
    return path
