"""The UTF-8 guard: after a lead byte whose next byte UTF-8 narrows (E0, ED, F0, F4), a constrained
request cannot continue with a byte outside that range, though xgrammar's matcher alone accepts it."""

from __future__ import annotations

import pytest

from kvtide.models.demo import build_byte_tokenizer
from kvtide.sampling_params import StructuredOutputsParams
from kvtide.structured_output.grammar import RequestGrammar
from kvtide.structured_output.grammars import build_grammar
from kvtide.structured_output.utf8_guard import Utf8Guard


@pytest.fixture(scope="module")
def setup():
    import xgrammar as xgr

    tokenizer = build_byte_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(StructuredOutputsParams(json={"type": "string"})))
    byte_token = {data[0]: i for i, data in enumerate(info.decoded_vocab) if len(data) == 1 and i > 2}
    return compiled, Utf8Guard(info.decoded_vocab, len(tokenizer)), byte_token, len(tokenizer)


@pytest.mark.parametrize("data, valid", [
    (b'"\xe0\xa4\x85"', True),    # U+0905
    (b'"\xe0\x91\xbc"', False),   # overlong 3-byte form
    (b'"\xed\x9f\xbf"', True),    # U+D7FF
    (b'"\xed\xa0\x80"', False),   # a surrogate
    (b'"\xf0\x9f\x98\x80"', True),
    (b'"\xf0\x8f\xbf\xbf"', False),  # overlong 4-byte form
    (b'"\xf4\x90\x80\x80"', False),  # above U+10FFFF
])
def test_guarded_matcher_accepts_exactly_valid_utf8(setup, data, valid):
    compiled, guard, byte_token, _ = setup
    grammar = RequestGrammar(compiled, [1], None, guard)
    assert all(grammar.accept(byte_token[b]) for b in data) == valid


def test_the_matcher_alone_takes_a_surrogate(setup):
    """Why the guard exists: xgrammar 0.2.9's JSON string admits an encoded surrogate."""
    compiled, _, byte_token, _ = setup
    grammar = RequestGrammar(compiled, [1], None, None)
    assert all(grammar.accept(byte_token[b]) for b in b'"\xed\xa0\x80"')


def test_guarded_bitmask_masks_the_bytes_after_a_lead(setup):
    import xgrammar as xgr

    compiled, guard, byte_token, vocab_size = setup
    grammar = RequestGrammar(compiled, [1], None, guard)
    assert grammar.accept(byte_token[ord('"')]) and grammar.accept(byte_token[0xED])
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    assert grammar.fill_bitmask(bitmask, 0)
    allowed = {b for b, token in byte_token.items() if bitmask[0, token // 32] >> (token % 32) & 1}
    assert allowed == set(range(0x80, 0xA0))

