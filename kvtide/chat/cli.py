"""`kvtide chat --model M`: talk to a model in the terminal, each answer streamed as it is generated.

    kvtide chat --model demo
    kvtide chat --model ./my-instruct-model --system "Answer briefly." --temperature 0.7

The conversation is kept: every message is answered with the earlier turns in context (their KV
is reused from the prefix cache). Commands: /reset forgets the conversation (the --system message
stays), /exit, /quit or Ctrl-D leave (exit status 0). Ctrl-C while an answer streams stops that
answer and keeps what was shown of it in the conversation; Ctrl-C at the prompt leaves with exit
status 130 (the shell's convention for an interrupt).

With stdin not a terminal (a pipe or a file) there is no banner and no prompt: each non-empty
line is one message (the commands above work too), and each answer is written as exactly one line
of stdout, flushed at its end. So that one line is one answer, a newline inside an answer is
written as the two characters \\n, a carriage return as \\r, and a backslash as \\\\. The exit
status is 0 at end of input; Ctrl-C ends the current answer's line and exits with 130. Logs and
warnings go to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from kvtide.engine.chat_template import read_chat_template
from kvtide.engine_args import EngineArgs

PROMPT = ">>> "
COMMANDS_HELP = "/reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer"
EXIT_INTERRUPTED = 130


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every flag with its default."""


def register(subparsers) -> None:
    from kvtide.cli import add_sampling_args

    p = subparsers.add_parser("chat", help="chat with a model in the terminal (answers streamed)",
                              description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.add_argument("--chat-template", default=None,
                   help="chat template file or Jinja string overriding the tokenizer's (for models without one)")
    add_sampling_args(p, max_tokens_default=512)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from kvtide.cli import sampling_params_from_args

    # Flags first: a bad value is refused before the model loads.
    params = sampling_params_from_args(args)
    if args.system is not None and not args.system.strip():
        raise ValueError("--system must not be empty")
    chat_template = read_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    interactive = sys.stdin.isatty()
    try:
        from kvtide import LLM
        from kvtide.chat.session import ChatSession

        llm = LLM(**vars(engine_args))
        session = ChatSession(llm, params, system=args.system, chat_template=chat_template)
        if interactive:
            return _run_terminal(session, args.model)
        return _run_pipe(session)
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read stdout is gone (e.g. `| head -1`): stop quietly, and keep the interpreter
        # from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _answer(session, message: str, write) -> object:
    """Run one turn with Ctrl-C bound to session.interrupt(): the engine finishes the step it is
    in, then the request is aborted (a KeyboardInterrupt in the middle of a step could leave the
    scheduler half updated). Where SIGINT is ignored (a background job), it stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return session.send(message, on_text=write)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: session.interrupt())
    try:
        return session.send(message, on_text=write)
    finally:
        signal.signal(signal.SIGINT, previous)


def _write_flushed(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _run_terminal(session, model: str) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    note = " (random weights: its answers are noise)" if model == "demo" else ""
    print(f"kvtide chat: model {model}{note}\n{COMMANDS_HELP}", flush=True)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return EXIT_INTERRUPTED
        message = line.strip()
        command = _command(session, message)
        if command == "exit":
            return 0
        if command == "reset":
            print("(conversation cleared)", flush=True)
        if command is not None:
            continue
        if message.startswith("/") and " " not in message:
            print(f"unknown command {message}: {COMMANDS_HELP}", file=sys.stderr, flush=True)
            continue
        try:
            result = _answer(session, message, _write_flushed)
        except ValueError as e:  # refused before anything changed, e.g. the context is full
            print(f"error: {' '.join(str(e).split())} (/reset starts a new conversation)",
                  file=sys.stderr, flush=True)
            continue
        print(flush=True)
        if result.finish_reason == "length":
            print(f"(answer cut after {result.num_output_tokens} tokens: --max-tokens or the model's "
                  f"context length)", file=sys.stderr, flush=True)


def _command(session, message: str) -> str | None:
    """'exit', 'reset' (done), 'skip' (an empty line), or None: a message for the model."""
    if not message:
        return "skip"
    if message in ("/exit", "/quit"):
        return "exit"
    if message == "/reset":
        session.reset()
        return "reset"
    return None


def escape_line(text: str) -> str:
    """An answer as one line: backslash, newline and carriage return written as \\\\, \\n, \\r."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _run_pipe(session) -> int:
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # a stray byte is not worth a traceback
    try:
        for line in iter(sys.stdin.readline, ""):
            message = line.strip()
            command = _command(session, message)
            if command == "exit":
                return 0
            if command is not None:
                continue
            # Escaping is per character, so the pieces can be written as they come.
            result = _answer(session, message, lambda text: _write_flushed(escape_line(text)))
            _write_flushed("\n")
            if result.interrupted:
                return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C while waiting for input
        return EXIT_INTERRUPTED
    return 0
