"""`kvtide router` flags refused before anything starts, and the cache-aware policy's choices on
router Backend objects (no servers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtide.cli import main
from kvtide.router.backends import Backend, BackendPool
from kvtide.router.config import parse_backend_list
from kvtide.router.policies import CacheAware, RoundRobin
from kvtide.router.prefix_index import CHUNK_CHARS, PrefixIndex, chunk_hashes


def test_no_backends_exits_2_with_message():
    proc = subprocess.run([sys.executable, "-m", "kvtide.cli", "router", "--policy", "round_robin"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "give at least one backend" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--backends", "not-a-url"], "malformed URL 'not-a-url'"),
    (["--backends", "http://127.0.0.1:99999"], "malformed URL"),
    (["--backends", "ftp://127.0.0.1:8000"], "malformed URL"),
    (["--backends", "http://127.0.0.1:8000", "--policy", "fastest"], "invalid choice: 'fastest'"),
    (["--prefill", "http://127.0.0.1:8000"], "--prefill and --decode go together"),
    (["--decode", "http://127.0.0.1:8000"], "--prefill and --decode go together"),
    (["--backends", "http://127.0.0.1:8000", "--cache-threshold", "2"], "--cache-threshold"),
    (["--backends", "http://127.0.0.1:8000", "--api-key", "k", "--api-keys-file", "f"], "not both"),
])
def test_bad_flags_exit_2_with_message(argv, message, capsys):
    try:
        code = main(["router", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_backend_list_parsing():
    assert parse_backend_list(" http://a:1/, https://b:2,http://a:1 ", "--backends") == ["http://a:1", "https://b:2"]


def test_prefix_hashes_chain():
    text = "x" * (3 * CHUNK_CHARS + 5)
    hashes = chunk_hashes(text)
    assert len(hashes) == 3
    assert len(set(hashes)) == 3  # equal chunks, different prefixes
    assert chunk_hashes("y" + text[1:])[0] != hashes[0]
    index = PrefixIndex()
    index.insert("b0", hashes[:2])
    assert index.matched_chunks("b0", hashes) == 2
    assert index.matched_chunks("b1", hashes) == 0


def test_prefix_index_lru_keeps_short_prefixes_longest():
    index = PrefixIndex(max_entries=3)
    hashes = chunk_hashes("z" * 5 * CHUNK_CHARS)
    index.insert("b", hashes)
    assert index.size("b") == 3
    assert index.matched_chunks("b", hashes) == 3  # the 3 shortest prefixes were kept


def _pool(n: int) -> list[Backend]:
    return [Backend(f"http://127.0.0.1:{9000 + i}", healthy=True) for i in range(n)]


def test_cache_aware_follows_prefix_then_spills_when_overloaded():
    backends = _pool(2)
    policy = CacheAware(BackendPool("backends", backends), cache_threshold=0.5, balance_threshold=2)
    hot = "shared system prompt " * 20
    first = policy.choose(hot + "question 0", set())
    assert first is not None and not first.by_prefix
    home = first.backend
    for i in range(1, 4):
        home.in_flight = i - 1  # within the balance threshold of the idle other backend
        choice = policy.choose(hot + f"question {i}", set())
        assert choice is not None and choice.by_prefix and choice.backend is home
    home.in_flight = 3  # 3 more than the other one: over the threshold, the prefix spills
    spill = policy.choose(hot + "question 9", set())
    assert spill is not None and not spill.by_prefix and spill.backend is not home
    # A prompt sharing too little of its text goes by load.
    other = policy.choose("completely different " * 30, set())
    assert other is not None and not other.by_prefix


def test_policies_skip_unhealthy_and_tried_backends():
    backends = _pool(3)
    backends[1].healthy = False
    rr = RoundRobin(BackendPool("backends", backends))
    picked = [rr.choose("", set()).backend for _ in range(4)]  # type: ignore[union-attr]
    assert backends[1] not in picked and set(picked) == {backends[0], backends[2]}
    assert rr.choose("", {backends[0], backends[2]}) is None
