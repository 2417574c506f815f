"""Fault injection for reliability tests, off unless KVTIDE_FAULT_INJECT is set.

    KVTIDE_FAULT_INJECT="nan_token=257,raise_token=258,raise_after_steps=40,sleep_s=0.01,stall_token=259"

The model runner calls `FAULTS.on_logits(logits, prompts)` once per step that samples, with the
step's logits (num_sampling_rows, vocab_size) and each sampling row's prompt token ids. Each key
arms one fault:

    nan_token=T          rows whose prompt contains token T get NaN logits: that request fails,
                         the others in the batch go on (a per-request failure)
    raise_token=T        raise InjectedFault when a row's prompt contains token T (the engine
                         core dies: a fatal step error)
    raise_after_steps=N  raise InjectedFault on the (N+1)-th sampling step
    sleep_s=S            sleep S seconds in every sampling step (a slow forward pass)
    stall_token=T        sleep stall_s (default 3600) seconds once a row's prompt contains T
                         (a hung forward pass, for the API process's watchdog)
    stall_s=S

`FAULTS` is None when the variable is unset or empty, so the hook costs one `is not None` test.
An unknown key raises at import: a typo must not silently disarm a test.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "KVTIDE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised inside the forward pass by raise_token / raise_after_steps."""


@dataclass
class FaultInjector:
    nan_token: int | None = None
    raise_token: int | None = None
    raise_after_steps: int | None = None
    sleep_s: float = 0.0
    stall_token: int | None = None
    stall_s: float = 3600.0
    num_steps: int = 0

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        fields: dict[str, Any] = {}
        for item in spec.replace(";", ",").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in ("nan_token", "raise_token", "raise_after_steps", "sleep_s",
                                      "stall_token", "stall_s"):
                raise ValueError(f"{ENV_VAR}: cannot parse {item!r} (want key=value with a known key)")
            fields[key] = float(value) if key in ("sleep_s", "stall_s") else int(value)
        return cls(**fields)

    def on_logits(self, logits: Any, prompts: list[list[int]]) -> None:
        """Called by the model runner with (num_rows, vocab) logits before sampling; may modify
        them in place, sleep or raise."""
        self.num_steps += 1
        if self.raise_after_steps is not None and self.num_steps > self.raise_after_steps:
            raise InjectedFault(f"injected fault after {self.raise_after_steps} steps")
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        for row, prompt in enumerate(prompts):
            if self.raise_token is not None and self.raise_token in prompt:
                raise InjectedFault(f"injected fault: a prompt contains token {self.raise_token}")
            if self.stall_token is not None and self.stall_token in prompt:
                logger.warning("injected stall of %.0f s", self.stall_s)
                time.sleep(self.stall_s)
            if self.nan_token is not None and self.nan_token in prompt:
                logits[row] = float("nan")


def from_env() -> FaultInjector | None:
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None
    injector = FaultInjector.parse(spec)
    logger.warning("fault injection armed: %s", injector)
    return injector


FAULTS: FaultInjector | None = from_env()
