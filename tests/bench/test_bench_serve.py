"""`kvtide bench serve` against fake OpenAI-compatible servers: failures counted, never fast."""

from __future__ import annotations

import json

import pytest
from bench_fake_server import ServerThread, make_app

from kvtide.cli import main as kvtide_main


def serve_argv(url: str, tmp_path, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--model", "fake-model", "--tokenizer", "demo",
            "--output-json", str(tmp_path / "serve.json"), "--disable-tqdm", *extra]


def test_faulty_server_failures_counted(tmp_path, capsys):
    app = make_app(faulty=True)
    with ServerThread(app) as server:
        rc = kvtide_main(serve_argv(server.url, tmp_path, "--num-prompts", "12", "--input-len", "20",
                                    "--output-len", "6", "--max-concurrency", "4", "--seed", "1",
                                    "--goodput", "ttft:10000", "tpot:10000"))
    assert rc == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    # Requests 1..12 after the warm-up (0): k % 6 in {1, 2, 3, 4} fail -> 8 of 12.
    assert result["completed"] == 4 and result["failed"] == 8
    kinds = result["errors"]
    assert kinds == {"http 500": 2, "dropped": 2, "no [DONE]": 2, "no finish_reason": 2}
    assert result["total_output_tokens"] == 4 * 6 and result["num_short_outputs"] == 0
    assert {r["finish_reason"] for r in result["requests"] if r["success"]} == {"length"}
    assert result["good_requests"] == 4
    # Only successful requests have latencies, and they are real (2 ms per token on the fake).
    assert result["median_tpot_ms"] >= 1.5 and result["mean_ttft_ms"] >= 1.5
    assert result["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.05)
    assert result["num_preemptions"] == 2
    assert result["ignore_eos"] is True
    assert len(result["requests"]) == 12
    assert all(r["error"] for r in result["requests"] if not r["success"])
    body = app.state.fake["bodies"][-1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 6
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "Prefix cache hit rate:" in out


def test_ignore_eos_dropped_when_refused_and_rate_limited(tmp_path):
    app = make_app(faulty=False, reject_ignore_eos=True)
    with ServerThread(app) as server:
        rc = kvtide_main(serve_argv(server.url, tmp_path, "--num-prompts", "6", "--random-input-len", "8",
                                    "--random-output-len", "4", "--request-rate", "200", "--burstiness", "0.5",
                                    "--send-min-tokens"))
    assert rc == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["ignore_eos"] is False and result["min_tokens_sent"] is True
    body = app.state.fake["bodies"][-1]
    assert "ignore_eos" not in body and body["min_tokens"] == 4 and body["stream_options"]["include_usage"]
    assert result["request_rate"] == 200 and result["burstiness"] == 0.5


def test_empty_chunks_are_tokens_finish_chunk_is_not(tmp_path):
    app = make_app(faulty=False, empty_chunks=True)
    with ServerThread(app) as server:
        rc = kvtide_main(serve_argv(server.url, tmp_path, "--num-prompts", "3", "--input-len", "8",
                                    "--output-len", "6", "--max-concurrency", "1"))
    assert rc == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["completed"] == 3 and result["total_output_tokens"] == 18
    for r in result["requests"]:
        assert len(r["chunk_times"]) == 6 and r["generated_text"] == "xxx" and r["finish_reason"] == "length"


def test_datasets_end_to_end(tmp_path):
    """shared-prefix, multi-turn (history grows) and a ShareGPT file, each deterministic in --seed."""
    app = make_app(faulty=False, token_delay_s=0.0)
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi!"},
                           {"from": "human", "value": "how are you"}, {"from": "gpt", "value": "fine, thanks"}]},
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]))
    with ServerThread(app) as server:
        assert kvtide_main(serve_argv(server.url, tmp_path, "--dataset-name", "shared-prefix", "--num-prompts", "6",
                                      "--num-prefixes", "2", "--prefix-len", "32", "--suffix-len", "4",
                                      "--output-len", "3")) == 0
        bodies = app.state.fake["bodies"][1:]
        prefixes = {b["prompt"][:32] for b in bodies}
        assert len(prefixes) == 2 and len(bodies) == 6

        app.state.fake["bodies"].clear()
        assert kvtide_main(serve_argv(server.url, tmp_path, "--dataset-name", "multi-turn", "--num-prompts", "2",
                                      "--num-turns", "3", "--input-len", "5", "--output-len", "2",
                                      "--max-concurrency", "2")) == 0
        result = json.loads((tmp_path / "serve.json").read_text())
        assert result["completed"] == 6
        by_conv: dict = {}
        for r in result["requests"]:
            by_conv.setdefault(r["conversation_id"], []).append(r)
        for turns in by_conv.values():
            turns.sort(key=lambda r: r["turn"])
            assert [r["turn"] for r in turns] == [0, 1, 2]
            assert turns[0]["prompt_len"] < turns[1]["prompt_len"] < turns[2]["prompt_len"]  # history grows
            # Turns of a conversation run one after another.
            assert turns[1]["start_offset"] >= turns[0]["start_offset"] + turns[0]["e2el"] - 1e-6
        prompts = [b["prompt"] for b in app.state.fake["bodies"][1:]]
        assert any(p.count("Assistant:") == 2 and "xx" in p for p in prompts)  # replies are in the history

        app.state.fake["bodies"].clear()
        assert kvtide_main(serve_argv(server.url, tmp_path, "--dataset-name", "sharegpt", "--dataset-path",
                                      str(sharegpt), "--num-prompts", "5")) == 0
        result = json.loads((tmp_path / "serve.json").read_text())
        assert result["completed"] == 2
        sent = sorted((b["prompt"], b["max_tokens"]) for b in app.state.fake["bodies"][1:])
        assert sent == [("2+2?", 1), ("hello there", 3)]


def test_server_down_is_an_error(tmp_path, capsys):
    from bench_fake_server import free_port

    rc = kvtide_main(serve_argv(f"http://127.0.0.1:{free_port()}", tmp_path, "--num-prompts", "2"))
    assert rc == 2
    assert "warm-up request" in capsys.readouterr().err
