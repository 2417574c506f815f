"""The grammar compiler process: compiles one grammar at a time for the engine's CompilePool
(compile_pool.py) and sends each back serialized.

A grammar's compile time and memory grow with its size (ten thousand choices: minutes and
gigabytes), so it runs here, where a memory limit (RLIMIT_DATA, set after start-up so it bounds
what a compile takes) and the pool's kill on timeout hit only this process.

Protocol on stdin / stdout (stdout is moved aside at start so nothing else writes into it), one
frame each way per message: 4-byte big-endian header length, the header as JSON, then
header["size"] bytes of payload.

    -> {"tokenizer_info_path": <a file of TokenizerInfo JSON>, "memory_limit": bytes, "max_threads": n}
    <- {"ready": true}
    -> {"params": {StructuredOutputsParams fields}, "max_whitespace_cnt": n | null}
    <- {"ok": true, "seconds": s, "size": n} + the CompiledGrammar's JSON (n bytes), or
       {"ok": false, "error": "...", "kind": "invalid" | "memory"}
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import time
from typing import BinaryIO

from kvtide.child_process import die_with_parent

_HEADER = struct.Struct(">I")
NICENESS = 5
"""Compiles run below the engine's CPU priority: a long one must not slow the decode steps."""


def write_frame(stream: BinaryIO, header: dict, payload: bytes = b"") -> None:
    body = json.dumps({**header, "size": len(payload)}).encode()
    stream.write(_HEADER.pack(len(body)) + body + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> tuple[dict, bytes] | None:
    """The next (header, payload); None at end of stream (the other side is gone)."""
    raw = _read_exactly(stream, _HEADER.size)
    if raw is None:
        return None
    body = _read_exactly(stream, _HEADER.unpack(raw)[0])
    if body is None:
        return None
    header = json.loads(body)
    payload = _read_exactly(stream, header.get("size", 0)) if header.get("size") else b""
    return None if payload is None else (header, payload)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _data_bytes() -> int:
    """This process's data segment now (VmData: heap, anonymous mappings, thread stacks)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parent = os.getppid()
    die_with_parent()  # no compile outlives the engine that started it
    os.nice(NICENESS)
    if os.getppid() != parent:
        return
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints (xgrammar's, anyone's) go to stderr, never into the protocol
    setup = read_frame(requests)
    if setup is None:
        return
    import xgrammar as xgr

    from kvtide.sampling_params import StructuredOutputsParams
    from kvtide.structured_output.grammars import build_grammar, error_reason

    options = setup[0]
    with open(options["tokenizer_info_path"]) as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    compiler = xgr.GrammarCompiler(info, max_threads=options.get("max_threads", 8), cache_enabled=False)
    # a first compile starts xgrammar's threads (their stacks stay cached) and malloc's arenas,
    # so the limit below counts what a grammar takes, not that one-time set-up
    compiler.compile_grammar(xgr.Grammar.from_json_schema('{"type": "object", "properties": {"a": {}}}'))
    limit = options.get("memory_limit")
    if limit:
        ceiling = _data_bytes() + int(limit)
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, ceiling))
    write_frame(replies, {"ready": True})
    while (message := read_frame(requests)) is not None:
        header = message[0]
        start = time.perf_counter()
        try:
            grammar = build_grammar(StructuredOutputsParams(**header["params"]), header.get("max_whitespace_cnt"))
            payload = compiler.compile_grammar(grammar).serialize_json().encode()
        except MemoryError:
            write_frame(replies, {"ok": False, "kind": "memory", "error": "out of memory"})
            continue
        except Exception as e:  # a grammar xgrammar refuses (ValueError from build_grammar or its RuntimeError)
            kind = "memory" if "bad_alloc" in str(e) else "invalid"
            write_frame(replies, {"ok": False, "kind": kind, "error": error_reason(e)})
            continue
        write_frame(replies, {"ok": True, "seconds": time.perf_counter() - start}, payload)


if __name__ == "__main__":
    sys.exit(main())
