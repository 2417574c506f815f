"""Datasets: exact lengths, determinism in the seed, prompt files."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvtide.bench.datasets import (
    PromptMaker,
    add_dataset_args,
    build_dataset,
    file_dataset,
    render_turn_prompt,
)


def dataset_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(list(argv))


def test_random_exact_lengths_and_seeded(tokenizer):
    args = dataset_args("--num-prompts", "5", "--input-len", "37", "--output-len", "9", "--seed", "4")
    jobs = build_dataset(args, tokenizer)
    assert [j.prompt_lens[0] for j in jobs] == [37] * 5
    assert all(len(tokenizer.encode(j.user_turns[0], add_special_tokens=False)) == 37 for j in jobs)
    assert [j.output_lens for j in jobs] == [[9]] * 5
    assert [j.user_turns for j in build_dataset(args, tokenizer)] == [j.user_turns for j in jobs]
    other = build_dataset(dataset_args("--num-prompts", "5", "--input-len", "37", "--seed", "5"), tokenizer)
    assert [j.user_turns for j in other] != [j.user_turns for j in jobs]


def test_range_ratio(tokenizer):
    jobs = build_dataset(dataset_args("--num-prompts", "50", "--input-len", "20", "--output-len", "10",
                                      "--random-range-ratio", "0.5"), tokenizer)
    lens = [j.prompt_lens[0] for j in jobs]
    outs = [j.output_lens[0] for j in jobs]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 3
    assert min(outs) >= 5 and max(outs) <= 15


def test_prompt_maker_other_tokenizer(llama_dir):
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(llama_dir), np.random.default_rng(0))
    text, n = maker.text(64)
    assert n == 64


def test_jsonl_file(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "abc", "output_len": 7}), json.dumps("plain"), "",
                               json.dumps({"prompt": ""})]))
    jobs = file_dataset(str(path), PromptMaker(tokenizer, np.random.default_rng(0)), 10, None)
    assert sorted((j.user_turns[0], j.output_lens[0]) for j in jobs) == [("abc", 7), ("plain", 128)]
    with pytest.raises(ValueError, match="does not exist"):
        file_dataset(str(tmp_path / "missing"), PromptMaker(tokenizer, np.random.default_rng(0)), 1, None)


def test_render_turn_prompt():
    assert render_turn_prompt([], "hi") == "hi"
    assert render_turn_prompt([("hi", "yo")], "more") == "User: hi\nAssistant: yo\nUser: more\nAssistant:"


def test_grounded_requests_copy_their_input(tokenizer):
    """The speculative-decoding workload: chat requests whose prompt holds the text to reproduce."""
    jobs = build_dataset(dataset_args("--dataset-name", "grounded", "--num-prompts", "11", "--output-len", "64"),
                         tokenizer)
    assert len(jobs) == 11 and all(j.output_lens == [64] for j in jobs)
    assert jobs[9].user_turns == jobs[0].user_turns and len({j.user_turns[0] for j in jobs}) == 9
    for job in jobs:  # no chat template on the byte tokenizer: the request text as it is
        assert job.prompt_token_ids == tokenizer.encode(job.user_turns[0], add_special_tokens=False)
        assert job.prompt_lens == [len(job.prompt_token_ids)]
        assert "Repeat" in job.user_turns[0] or "Rewrite" in job.user_turns[0]


def test_builtin_model_names_size_prompts_with_their_own_tokenizer():
    """`bench serve --model smollm2` against a server of the built-in model: its tokenizer and chat
    template, not the byte fallback (the grounded requests would lose their chat turns)."""
    from kvtide.bench.datasets import load_tokenizer_for_bench

    tokenizer = load_tokenizer_for_bench(None, "smollm2")
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    jobs = build_dataset(dataset_args("--dataset-name", "grounded", "--num-prompts", "1"), tokenizer)
    assert jobs[0].user_turns[0].startswith("<|im_start|>")
