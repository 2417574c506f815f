"""Triton kernel tests: natively on CUDA when KVTIDE_TEST_DEVICE=cuda (scripts/gpu_check.sh), else
on the CPU under Triton's interpreter.

Triton decides per function, when `@triton.jit` decorates it, whether it is compiled or
interpreted; that includes its own library (tl.zeros, tl.maximum, ...), decorated when triton is
first imported. So the interpreter needs TRITON_INTERPRET=1 before the session's first
`import triton`. Two ways, chosen when this file loads:

  in process   triton not imported yet (or TRITON_INTERPRET=1 already set): set the variable,
               import triton and our kernel modules, restore the environment; tests marked
               `triton` run here with the variable set only while each runs (Triton reads it at
               launch too), so nothing else in the session sees it.
  subprocess   something imported triton first (importing transformers' models does): the
               `triton` tests are deselected here and test_triton_subprocess.py runs them in a
               child pytest that starts with TRITON_INTERPRET=1.

The interpreter also stores bf16 as raw uint16 and would multiply the bit patterns in tl.dot;
`_teach_interpreter_bf16_dot` upcasts them (compiled kernels need no such help).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys

import pytest
import torch

DEVICE = os.environ.get("KVTIDE_TEST_DEVICE", "cpu")
TRITON_MODULES = ("kvtide.attention.triton_kernels", "kvtide.layers.triton_ops",
                  "kvtide.layers.quantization.triton_kernels", "kvtide.layers.moe.triton_moe",
                  "kvtide.lora.triton_ops")
HERE = pathlib.Path(__file__).resolve().parent


def _prepare_interpreter() -> bool:
    """Import triton and our kernels interpreted; False if triton was already imported compiled."""
    if importlib.util.find_spec("triton") is None:
        return True  # the triton test modules skip themselves
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
        return False
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in TRITON_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    _teach_interpreter_bf16_dot()
    return True


def _teach_interpreter_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    if getattr(original, "upcasts_bf16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.upcasts_bf16 = True  # type: ignore[attr-defined]
    InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


if DEVICE == "cuda":
    if not torch.cuda.is_available():
        pytest.exit("KVTIDE_TEST_DEVICE=cuda but torch sees no GPU", returncode=1)
    IN_PROCESS = True
else:
    IN_PROCESS = _prepare_interpreter()


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs Triton kernels (interpreted on the CPU)")


def pytest_collection_modifyitems(config, items):
    """Subprocess mode: deselect the `triton` tests here; test_triton_subprocess.py runs them."""
    if IN_PROCESS:
        return
    moved = [i for i in items if HERE in i.path.parents and i.get_closest_marker("triton")]
    if moved:
        config.hook.pytest_deselected(items=moved)
        moved_ids = {id(i) for i in moved}
        items[:] = [i for i in items if id(i) not in moved_ids]


@pytest.fixture(scope="session")
def triton_in_process() -> bool:
    return IN_PROCESS


@pytest.fixture(autouse=True)
def _interpret_while_testing(request, monkeypatch):
    """Triton also reads TRITON_INTERPRET at launch (lazy imports): set only during triton tests."""
    if DEVICE == "cpu" and request.node.get_closest_marker("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance: float32 1e-4, bf16 2e-2 (relative, and absolute near zero)."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=tol, atol=tol)


@pytest.fixture
def close():
    return assert_close


from paged_batches import PagedBatch, make_paged_batch  # noqa: E402,F401  (shared with tests/attention)


@pytest.fixture
def paged_batch():
    return make_paged_batch
