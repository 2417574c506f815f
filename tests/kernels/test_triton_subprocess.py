"""Runs this directory's `triton` tests in a child pytest under TRITON_INTERPRET=1 when this
session imported triton compiled before the kernels' conftest could arrange the interpreter (see
conftest.py). Skipped whenever they already run in this process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def test_triton_tests_under_the_interpreter_in_a_child_process(triton_in_process):
    if triton_in_process:
        pytest.skip("the triton tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton",
                             str(HERE)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
