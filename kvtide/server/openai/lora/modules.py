"""The LoRA adapters a server serves by name: a request picks one by its `model` field.

    --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}'

Names map to LoRARequests with ids handed out here (never reused, so a name unloaded and loaded
again gets KV blocks of its own). Loading goes through the engine core, which checks the adapter
against the model before the name is taken.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass

from kvtide import LoRARequest
from kvtide.engine.core_client import EngineGenerateError
from kvtide.server.errors import OpenAIError

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModuleSpec:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(specs: list[str] | None) -> list[LoRAModuleSpec]:
    """`name=path` or a JSON object {"name", "path", "base_model_name"} each; ValueError naming a bad one."""
    modules: list[LoRAModuleSpec] = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                raw = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {spec!r} is not valid JSON ({e})") from e
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
                raise ValueError(f"--lora-modules: {spec!r} needs string fields name and path")
            module = LoRAModuleSpec(raw["name"], raw["path"], raw.get("base_model_name"))
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {spec!r} is not name=path")
            module = LoRAModuleSpec(name, path)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        modules.append(module)
    return modules


def runtime_updating_allowed(flag: bool) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable set to a true value."""
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


class LoRAModules:
    """name -> LoRARequest of the adapters served now."""

    def __init__(self, base_model_names: list[str], allow_runtime_updating: bool = False) -> None:
        self.base_model_names = base_model_names
        self.allow_runtime_updating = allow_runtime_updating
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    async def load(self, engine, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load an adapter under `name`: 400 for a name taken (a base model's or an adapter's) or a
        bad adapter, with nothing changed."""
        async with self._lock:
            if name in self.adapters or name in self.base_model_names:
                raise OpenAIError(f"The lora adapter `{name}` has already been loaded.", 400, param="lora_name",
                                  code="lora_adapter_exists")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await engine.add_lora(request)
            except EngineGenerateError as e:  # the engine core refused it: the adapter is at fault
                message = str(e).removeprefix("ValueError: ")
                raise OpenAIError(message, 400, param="lora_path", code="invalid_lora_adapter") from e
            self.adapters[name] = request
            return request

    async def unload(self, engine, name: str) -> None:
        """Stop serving `name` now (404 if unknown); requests running with it finish first."""
        async with self._lock:
            request = self.adapters.pop(name, None)
            if request is None:
                raise OpenAIError(f"The lora adapter `{name}` cannot be found.", 404, param="lora_name",
                                  code="model_not_found")
            await engine.remove_lora(request.lora_int_id)
