"""`kvtide run-batch -i in.jsonl -o out.jsonl --model M`: an OpenAI batch file, offline.

    kvtide run-batch -i requests.jsonl -o results.jsonl --model ./my-llama
    kvtide run-batch -i requests.jsonl -o results.jsonl --model ./my-llama --resume   # after a stop

Each input line is {"custom_id", "method": "POST", "url", "body"} with url /v1/chat/completions or
/v1/completions (/v1/embeddings lines get a per-line error: this engine serves no embeddings). Each
line goes through the server's own route in this process, so its answer, or its error, is the one
`kvtide serve` would give; lines run concurrently and batch in the engine. Results are written in
input order, one flushed line each, in OpenAI's batch output format; a bad line gets an error
record, never stops the run. --resume keeps the output file and skips the lines whose custom_id
already has a result there (a line cut off by a kill is dropped and rerun).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from kvtide.batch.file_format import count_results, dump_record, read_lines
from kvtide.engine_args import EngineArgs

RENDER_TIMEOUT_S = 60.0
"""Seconds a line's chat template may render and its prompt wait for the tokenizer (the server's
--render-timeout, which guards interactive latency, is 2 s)."""


def register(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="batch input, JSONL")
    p.add_argument("-o", "--output-file", required=True, help="where the results go, JSONL (replaced unless "
                                                              "--resume)")
    p.add_argument("--resume", action="store_true",
                   help="append to the output file, skipping lines whose custom_id it already answers")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) a line's body may name (default: --model)")
    p.add_argument("--chat-template", default=None, help="chat template file or Jinja string overriding the "
                                                         "tokenizer's")
    p.add_argument("--max-concurrent-lines", type=int, default=None,
                   help="lines in the engine at once (default: --max-num-seqs)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    if not os.path.isfile(args.input_file):
        raise ValueError(f"--input-file {args.input_file}: no such file")
    concurrency = args.max_concurrent_lines or engine_args.max_num_seqs
    if concurrency < 1:
        raise ValueError("--max-concurrent-lines must be >= 1")
    engine_args.check_local_checkpoint()
    from kvtide.engine.chat_template import read_chat_template

    chat_template = read_chat_template(args.chat_template)
    done = count_results(args.output_file) if args.resume else None
    if not args.resume:
        open(args.output_file, "wb").close()
    return asyncio.run(_run(engine_args, args, chat_template, concurrency, done))


async def _run(engine_args: EngineArgs, args: argparse.Namespace, chat_template: str | None, concurrency: int,
               done: Any) -> int:
    from tqdm import tqdm

    from kvtide.batch.runner import BatchRunner
    from kvtide.engine.async_llm import AsyncLLM
    from kvtide.server.api_server import build_app
    from kvtide.server.limits import RequestLimits
    from kvtide.server.metrics import ServerMetrics
    from kvtide.server.output_parsers import OutputParsers
    from kvtide.server.state import ServerSettings, ServerState

    names = args.served_model_name or [engine_args.model]
    metrics = ServerMetrics(names[0])
    engine = await AsyncLLM.from_engine_args(engine_args, stat_logger=metrics)
    try:
        # Offline, a line may wait longer for the tokenizer than an interactive client would.
        limits = RequestLimits(render_timeout_s=RENDER_TIMEOUT_S)
        settings = ServerSettings(served_model_names=names, chat_template=chat_template, enable_ui=False,
                                  request_limits=limits)
        state = ServerState(engine=engine, settings=settings, metrics=metrics,
                            parsers=OutputParsers.create(engine.tokenizer, None, False, None))
        runner = BatchRunner(build_app(state), max_concurrency=concurrency)
        num_lines = sum(1 for _ in read_lines(args.input_file))
        num_skipped = sum(done.values()) if done else 0
        with open(args.output_file, "ab") as out, \
                tqdm(total=max(0, num_lines - num_skipped), desc="Batch lines", unit="line", file=sys.stderr,
                     disable=not args.progress) as bar:
            def emit(record: dict[str, Any]) -> None:
                out.write(dump_record(record))
                out.flush()
                bar.update(1)

            counts = await runner.run(read_lines(args.input_file), emit, done)
        print(f"run-batch: {counts.total} line(s) answered ({counts.completed} ok, {counts.failed} failed"
              f"{f', {num_skipped} already done' if num_skipped else ''}) -> {args.output_file}", file=sys.stderr)
    finally:
        engine.shutdown()
    return 0
