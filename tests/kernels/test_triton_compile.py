"""The Triton kernels compile to cubin for sm_90 (Triton's bundled ptxas, no GPU needed): layouts,
tl.dot shape rules and shared memory that the interpreter never checks. Runs compile_check.py in a
clean process, since kernels imported under the interpreter cannot be compiled."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = pathlib.Path(__file__).resolve().parent


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(HERE / "compile_check.py")], env=env, capture_output=True,
                            text=True, timeout=600, cwd=HERE.parents[1])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    assert result.stdout.count("OK ") >= 11, result.stdout
