"""`kvtide` command line: generate (offline), chat (interactive), serve (OpenAI-compatible server), router
(one endpoint in front of several servers), bench.

Each subcommand module exposes `register(subparsers)`; engine flags come from EngineArgs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvtide.engine_args import EngineArgs

_SUBCOMMAND_MODULES = {"chat": "kvtide.chat.cli", "serve": "kvtide.server.cli", "bench": "kvtide.bench.cli",
                       "router": "kvtide.router.cli"}
_SUBCOMMAND_MODULES["run-batch"] = "kvtide.batch.cli"  # an OpenAI batch file, offline


def register_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate completions offline",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL file: one {\"prompt\": ...} object (or a string) per line")
    add_sampling_args(p, max_tokens_default=64)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_generate)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens_default: int) -> None:
    """The sampling flags shared by `generate` and `chat` (SamplingParams' fields, vLLM's names)."""
    p.add_argument("--max-tokens", type=int, default=max_tokens_default)
    # Unset: the model's generation_config.json (--generation-config) or the neutral default.
    p.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's, else -1 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0.0")
    p.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params_from_args(args: argparse.Namespace, n: int = 1):
    """SamplingParams from the flags of add_sampling_args; a bad value raises ValueError, so it
    is refused before the model loads."""
    from kvtide import SamplingParams
    from kvtide.sampling_params import GENERATION_DEFAULT_FIELDS

    model_defaulted = {name: getattr(args, name) for name in GENERATION_DEFAULT_FIELDS
                       if getattr(args, name) is not None}
    return SamplingParams(n=n, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                          seed=args.sampling_seed, **model_defaulted)


def _read_prompts(args) -> list:
    prompts: list = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.prompts_file}:{line_no}: not JSON ({e})") from e
                prompts.append(item if isinstance(item, (str, list)) else
                               item.get("prompt", item) if isinstance(item, dict) else item)
    if not prompts:
        raise ValueError("give --prompt TEXT or --prompts-file FILE.jsonl")
    return prompts


def run_generate(args) -> int:
    from kvtide import LLM

    prompts = _read_prompts(args)
    params = sampling_params_from_args(args, n=args.n)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for output in outputs:
        if args.json:
            print(json.dumps({"prompt": output.prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in output.outputs]}, ensure_ascii=False))
        else:
            for completion in output.outputs:
                print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or only `command`'s when it names one: `kvtide serve` then imports
    neither the benchmarks nor torch before it starts its engine core."""
    parser = argparse.ArgumentParser(prog="kvtide", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_generate(subparsers)
    modules = [_SUBCOMMAND_MODULES[command]] if command in _SUBCOMMAND_MODULES else _SUBCOMMAND_MODULES.values()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        # One line: a wrapped library message may span several, and scripts read the first line.
        print(f"kvtide {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
