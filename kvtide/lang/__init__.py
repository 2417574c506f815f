"""LLM programs: Python functions that interleave text, chat roles, `gen`, `select` and `fork`,
run on kvtide in-process (`Engine`) or on a kvtide server (`Endpoint`) with the shared prefix
computed once (docs/lang.md).

    import kvtide.lang as kl

    @kl.function
    def plan(s, topic):
        s += kl.user(f"Three steps to learn {topic}.")
        s += kl.assistant(kl.gen("steps", max_tokens=64))

    state = plan.run(topic="Rust", backend=kl.Engine(llm))
"""

from kvtide.lang.endpoint_backend import Endpoint, EndpointError
from kvtide.lang.engine_backend import Engine
from kvtide.lang.ops import assistant, gen, select, system, user
from kvtide.lang.program import Program, function, set_default_backend
from kvtide.lang.state import ForkGroup, ProgramState

__all__ = ["Endpoint", "EndpointError", "Engine", "ForkGroup", "Program", "ProgramState", "assistant",
           "function", "gen", "select", "set_default_backend", "system", "user"]
