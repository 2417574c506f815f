"""Benchmark workloads: random, shared-prefix, multi-turn conversations, prompt files, and prompts
paired with JSON schemas (json-schema, kvtide.bench.json_schemas).

Every dataset is a list of `Conversation`s; a plain request is a conversation of one turn. Turn k of a
conversation is sent after turn k-1 has finished, with the history (earlier user turns and the replies
the server actually gave) in front of it, so the prompt grows turn by turn.

Prompts are text made of vocabulary tokens that round-trip through the tokenizer, so a prompt of N
tokens is N tokens for the server too (±1 at seams where tokens merge; the server's own count,
usage.prompt_tokens, is what the report uses when the server gives it). Everything is drawn from one
numpy Generator seeded with --seed: the same flags give the same prompts.

Structured output: a job may be paired with a constraint (vLLM's `structured_outputs` object, e.g.
{"json": SCHEMA}); --structured-output-ratio then picks, by --seed and after the prompts are drawn,
which of those jobs send it, so ratio 0 and ratio 1 send the same prompts:

    kvtide bench serve ... --dataset-name json-schema --structured-output-ratio 0    # unconstrained
    kvtide bench serve ... --dataset-name jsonl --dataset-path items.jsonl           # {"prompt", "schema"}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from kvtide.bench.json_schemas import DEFAULT_OUTPUT_LEN as JSON_SCHEMA_OUTPUT_LEN
from kvtide.bench.json_schemas import json_schema_jobs

DATASET_NAMES = ("random", "shared-prefix", "multi-turn", "jsonl", "sharegpt", "grounded", "json-schema")


@dataclass
class Conversation:
    """One job of the benchmark: user turns sent one after another, each with its max_tokens."""

    user_turns: list[str]
    output_lens: list[int]
    prompt_lens: list[int] = field(default_factory=list)
    """Tokens of each user turn alone (the first turn's is the whole first prompt)."""
    prompt_token_ids: list[int] | None = None
    """Single-turn token-id prompt, for engines that take ids (offline benchmarks)."""
    structured_outputs: dict | None = None
    """The constraint the dataset pairs with this job (vLLM's structured_outputs object)."""
    constrained: bool = False
    """Whether its requests send that constraint (--structured-output-ratio picks)."""

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


def render_turn_prompt(history: list[tuple[str, str]], user_turn: str) -> str:
    """The completions prompt of a turn: earlier (user, reply) pairs, then the new user turn.

    A single-turn conversation is its user turn verbatim."""
    if not history:
        return user_turn
    parts = [f"User: {u}\nAssistant: {a}\n" for u, a in history]
    return "".join(parts) + f"User: {user_turn}\nAssistant:"


class PromptMaker:
    """Random text of an exact token length, from tokens that decode and re-encode to themselves."""

    def __init__(self, tokenizer, rng: np.random.Generator, pool_size: int = 2048) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.pool = self._round_trip_pool(pool_size)

    def _round_trip_pool(self, pool_size: int) -> np.ndarray:
        tok = self.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or [])
        # Added tokens are matched whole in text by some servers and not by others: keep to the base
        # vocabulary.
        special |= set((tok.get_added_vocab() if hasattr(tok, "get_added_vocab") else {}).values())
        vocab_size = len(tok)
        candidates = np.arange(vocab_size)
        if vocab_size > 4 * pool_size:  # deterministic subsample, independent of --seed
            candidates = np.random.default_rng(0).choice(vocab_size, 4 * pool_size, replace=False)
            candidates.sort()
        pool = []
        for token_id in candidates.tolist():
            if token_id in special:
                continue
            text = tok.decode([token_id])
            if not text.strip() or not text.isprintable() or "\ufffd" in text:
                continue
            if tok.encode(text, add_special_tokens=False) == [token_id]:
                pool.append(token_id)
            if len(pool) >= pool_size:
                break
        if not pool:
            raise ValueError("the tokenizer has no tokens that round-trip through decode/encode; "
                             "cannot make random prompts with it")
        return np.asarray(pool)

    def token_ids(self, num_tokens: int) -> list[int]:
        return self.rng.choice(self.pool, size=num_tokens).tolist()

    def text(self, num_tokens: int) -> tuple[str, int]:
        """(text, its token count without special tokens), the count as close to num_tokens as the
        tokenizer allows."""
        if num_tokens <= 0:
            return "", 0
        tok = self.tokenizer
        ids = self.token_ids(num_tokens)
        text = tok.decode(ids)
        for _ in range(4):
            encoded = tok.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                break
            if len(encoded) > num_tokens:
                text = tok.decode(encoded[:num_tokens])
            else:
                text = tok.decode(encoded + self.token_ids(num_tokens - len(encoded)))
        return text, len(tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)] (at least 1), as vLLM's random dataset."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def random_dataset(maker: PromptMaker, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, token_ids: bool = False) -> list[Conversation]:
    rng = maker.rng
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    jobs = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        if token_ids:
            ids = maker.token_ids(n_in)
            jobs.append(Conversation([maker.tokenizer.decode(ids)], [n_out], [n_in], prompt_token_ids=ids))
        else:
            text, n = maker.text(n_in)
            jobs.append(Conversation([text], [n_out], [n]))
    return jobs


def shared_prefix_dataset(maker: PromptMaker, num_prompts: int, num_prefixes: int, prefix_len: int,
                          suffix_len: int, output_len: int) -> list[Conversation]:
    """num_prompts requests over num_prefixes distinct prefixes (round robin, then shuffled)."""
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be >= 1, got {num_prefixes}")
    prefixes = [maker.text(prefix_len)[0] for _ in range(num_prefixes)]
    jobs = []
    for i in range(num_prompts):
        suffix, _ = maker.text(suffix_len)
        text = prefixes[i % num_prefixes] + suffix
        jobs.append(Conversation([text], [output_len], [maker.count(text)]))
    order = maker.rng.permutation(len(jobs))
    return [jobs[i] for i in order]


def multi_turn_dataset(maker: PromptMaker, num_conversations: int, num_turns: int, turn_input_len: int,
                       output_len: int, range_ratio: float = 0.0) -> list[Conversation]:
    if num_turns < 1:
        raise ValueError(f"--num-turns must be >= 1, got {num_turns}")
    jobs = []
    for _ in range(num_conversations):
        in_lens = _lengths(maker.rng, turn_input_len, range_ratio, num_turns)
        out_lens = _lengths(maker.rng, output_len, range_ratio, num_turns)
        texts = [maker.text(n) for n in in_lens]
        jobs.append(Conversation([t for t, _ in texts], out_lens, [n for _, n in texts]))
    return jobs


def file_dataset(path: str, maker: PromptMaker, num_prompts: int, output_len: int | None,
                 multi_turn: bool = False) -> list[Conversation]:
    """A JSONL file of prompts ({"prompt": str, "output_len"|"max_tokens": int} or a bare string per
    line), or a ShareGPT file (a JSON list, or JSONL, of {"conversations": [{"from", "value"}]}).

    ShareGPT: the human turns are the prompts; each reply's token count is that turn's max_tokens
    unless --output-len is given. Without multi_turn only the first exchange is used (as vLLM does)."""
    if not os.path.exists(path):
        raise ValueError(f"--dataset-path {path!r} does not exist")
    items = _read_json_items(path)
    jobs: list[Conversation] = []
    for item in items:
        job = _job_from_item(item, maker, output_len, multi_turn)
        if job is not None:
            jobs.append(job)
    if not jobs:
        raise ValueError(f"{path}: no usable prompts")
    order = maker.rng.permutation(len(jobs))
    return [jobs[i] for i in order[:num_prompts]]


def _read_json_items(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return list(data)
    items = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
    return items


def _job_from_item(item, maker: PromptMaker, output_len: int | None, multi_turn: bool) -> Conversation | None:
    default_out = output_len or 128
    if isinstance(item, str):
        return Conversation([item], [default_out], [maker.count(item)]) if item else None
    if not isinstance(item, dict):
        return None
    if "conversations" in item:
        turns = item["conversations"]
        users, outs = [], []
        for i, turn in enumerate(turns):
            if turn.get("from") not in ("human", "user"):
                continue
            reply = turns[i + 1].get("value", "") if i + 1 < len(turns) else ""
            users.append(turn.get("value", ""))
            outs.append(output_len or max(1, maker.count(reply)))
            if not multi_turn:
                break
        users_outs = [(u, o) for u, o in zip(users, outs, strict=True) if u]
        if not users_outs:
            return None
        return Conversation([u for u, _ in users_outs], [o for _, o in users_outs],
                            [maker.count(u) for u, _ in users_outs])
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return None
    out = output_len or int(item.get("output_len") or item.get("max_tokens") or default_out)
    return Conversation([prompt], [out], [maker.count(prompt)], structured_outputs=_item_constraint(item))


def _item_constraint(item: dict) -> dict | None:
    """A file item's constraint: "schema" (a JSON schema, or its text) or "structured_outputs"."""
    if item.get("structured_outputs") is not None:
        constraint = item["structured_outputs"]
        if not isinstance(constraint, dict) or not constraint:
            raise ValueError(f"a prompt item's structured_outputs must be an object, got {constraint!r}")
        return dict(constraint)
    schema = item.get("schema")
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"a prompt item's schema is not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a prompt item's schema must be a JSON object, got {schema!r}")
    return {"json": schema}


def select_constrained(jobs: list[Conversation], ratio: float, seed: int) -> list[Conversation]:
    """Mark round(ratio * n) of the n jobs that have a constraint as sending it, chosen by seed from a
    generator of their own (the prompts do not depend on the ratio)."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    candidates = [i for i, job in enumerate(jobs) if job.structured_outputs is not None]
    chosen = np.random.default_rng([seed, 2]).permutation(len(candidates))[:round(ratio * len(candidates))]
    picked = {candidates[i] for i in chosen.tolist()}
    for i, job in enumerate(jobs):
        job.constrained = i in picked
    return jobs


def json_schema_dataset(maker: PromptMaker, num_prompts: int, output_len: int, seed: int,
                        any_whitespace: bool = False) -> list[Conversation]:
    return [Conversation([prompt], [output_len], [maker.count(prompt)], structured_outputs=constraint)
            for prompt, constraint in json_schema_jobs(num_prompts, seed, any_whitespace)]


def load_tokenizer_for_bench(tokenizer: str | None, model: str | None):
    """The tokenizer used to size prompts: --tokenizer, else --model when it names a local directory,
    a built-in model ('demo', 'smollm2') or a hub id in the local cache; else kvtide's byte tokenizer
    (lengths then approximate)."""
    from transformers import AutoTokenizer

    for name in (tokenizer, model):
        if not name:
            continue
        path = name
        if name in ("demo", "smollm2"):  # the built-in names, as the server resolves them
            from kvtide.engine_args import EngineArgs

            path = EngineArgs(model=name).resolve_model_dir()
        try:  # a hub id only from the local cache: a benchmark should not wait on the network
            return AutoTokenizer.from_pretrained(path, local_files_only=not os.path.isdir(path))
        except Exception:
            if name == tokenizer:
                raise ValueError(f"--tokenizer {tokenizer!r}: cannot load it") from None
    from kvtide.models.demo import build_byte_tokenizer

    return build_byte_tokenizer()


def build_dataset(args, tokenizer) -> list[Conversation]:
    """The dataset the flags name (`kvtide bench serve --help` lists them), its constrained jobs
    picked by --structured-output-ratio."""
    jobs = _build_jobs(args, tokenizer)
    return select_constrained(jobs, getattr(args, "structured_output_ratio", 1.0), args.seed)


def _build_jobs(args, tokenizer) -> list[Conversation]:
    maker = PromptMaker(tokenizer, np.random.default_rng(args.seed))
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    name = args.dataset_name
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    if output_len is None:
        output_len = JSON_SCHEMA_OUTPUT_LEN if name == "json-schema" else 128
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if name == "json-schema":
        return json_schema_dataset(maker, args.num_prompts, output_len, args.seed,
                                   getattr(args, "structured_output_any_whitespace", False))
    if name == "random":
        return random_dataset(maker, args.num_prompts, input_len, output_len, args.random_range_ratio)
    if name == "shared-prefix":
        return shared_prefix_dataset(maker, args.num_prompts, args.num_prefixes, args.prefix_len,
                                     args.suffix_len, output_len)
    if name == "multi-turn":
        if args.dataset_path:
            return file_dataset(args.dataset_path, maker, args.num_prompts, args.output_len, multi_turn=True)
        return multi_turn_dataset(maker, args.num_prompts, args.num_turns, input_len, output_len,
                                  args.random_range_ratio)
    if name == "grounded":
        return grounded_dataset(tokenizer, args.num_prompts, output_len)
    if name in ("jsonl", "sharegpt"):
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
        return file_dataset(args.dataset_path, maker, args.num_prompts, args.output_len)
    raise ValueError(f"--dataset-name must be one of {', '.join(DATASET_NAMES)}; got {name!r}")


_PARAGRAPHS = (
    "The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
    "climbed the narrow stairs, lit the great lamp and watched the ships pass safely through the dark water "
    "below. When the storms came, the light never failed, and the sailors of the town called it their star.",
    "Our team meets every Monday morning to plan the week. We review the open tasks, agree on who owns each "
    "one and note any risks. On Friday afternoon we meet again to check what was finished, what slipped and "
    "why, so that the next plan is a little better than the last one.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm water slowly and "
    "knead the dough for ten minutes, until it is smooth. Leave it to rise for an hour, shape it into a loaf "
    "and bake it in a hot oven for thirty minutes.",
)
_CODE = (
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n"
    "    return total\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step=1):\n"
    "        self.count += step\n        return self.count\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = [line.strip() for line in f]\n"
    "    return [line for line in lines if line]\n",
)


def grounded_conversations() -> list[list[dict]]:
    """Chat requests whose answer copies most of the prompt (repeat, rewrite, edit code): the
    workload where n-gram speculation pays, with real text."""
    tasks = []
    for i, paragraph in enumerate(_PARAGRAPHS):
        tasks.append(f"Repeat the following paragraph exactly, word for word:\n\n{paragraph}")
        tasks.append(f"Rewrite this paragraph, changing only its first sentence:\n\n{paragraph}")
        code = _CODE[i]
        tasks.append(f"Here is a Python snippet:\n\n{code}\nRepeat it exactly, adding a docstring to it.")
    return [[{"role": "user", "content": task}] for task in tasks]


def grounded_dataset(tokenizer, num_prompts: int, output_len: int) -> list[Conversation]:
    """grounded_conversations cycled to num_prompts, rendered with the tokenizer's chat template."""
    conversations = grounded_conversations()
    jobs = []
    for i in range(num_prompts):
        messages = conversations[i % len(conversations)]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) \
            if getattr(tokenizer, "chat_template", None) else messages[0]["content"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        jobs.append(Conversation([text], [output_len], [len(ids)], prompt_token_ids=ids))
    return jobs


def add_dataset_args(parser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    g.add_argument("--dataset-path", default=None,
                   help="JSONL of prompts, or a ShareGPT JSON/JSONL file (jsonl, sharegpt, multi-turn)")
    g.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (multi-turn: conversations)")
    g.add_argument("--input-len", type=int, default=None, help="same as --random-input-len")
    g.add_argument("--output-len", type=int, default=None,
                   help="same as --random-output-len; for files, overrides their lengths")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=None,
                   help="max_tokens per request (default: 128; json-schema: 256)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique tokens per request")
    g.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    g.add_argument("--tokenizer", default=None, help="tokenizer to size prompts (default: --model's)")
    g.add_argument("--structured-output-ratio", type=float, default=1.0,
                   help="fraction of the jobs with a constraint (json-schema; jsonl items with \"schema\" or "
                        "\"structured_outputs\") that send it; 0 sends the same prompts unconstrained")
    g.add_argument("--structured-output-any-whitespace", action="store_true",
                   help="json-schema: let the grammar admit any whitespace between JSON tokens (by default "
                        "the output is compact: a random model wanders in free whitespace until max_tokens)")
