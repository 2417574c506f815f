"""Incremental detokenizer and output processor: exact round trips, special tokens, stop strings.

The byte tokenizer maps each UTF-8 byte to one token (id = byte + 3; 0..2 are <s>, </s>, <pad>), so
multi-byte characters are split across tokens, and any byte string, valid UTF-8 or not, is a token
sequence."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtide.engine.detokenizer import IncrementalDetokenizer
from kvtide.engine.messages import EngineCoreOutput
from kvtide.engine.output_processor import OutputProcessor, RequestOutputKind
from kvtide.models.demo import BOS_ID, EOS_ID, PAD_ID, build_byte_tokenizer
from kvtide.sampling_params import SamplingParams

TOKENIZER = build_byte_tokenizer()
SPECIAL_IDS = [BOS_ID, EOS_ID, PAD_ID]
KINDS = list(RequestOutputKind)
# KVTIDE_FUZZ_EXAMPLES=5000 for a deeper search than the default tier's.
SETTINGS = settings(max_examples=int(os.environ.get("KVTIDE_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ids_of(data: bytes) -> list[int]:
    return [b + 3 for b in data]


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into steps of the given sizes (cycled), as a core emitting 1+ tokens per step."""
    steps, i, j = [], 0, 0
    while i < len(ids):
        size = sizes[j % len(sizes)] if sizes else 1
        steps.append(ids[i:i + size])
        i += size
        j += 1
    return steps


class SlowTokenizer:
    """A tokenizer without a `tokenizers` backend (no DecodeStream): full decodes only."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return TOKENIZER.convert_ids_to_tokens(token_id)


def run(prompt_ids: list[int], steps: list[list[int]], params: SamplingParams,
        finish_reason: str = "length", tokenizer=TOKENIZER):
    """Feed the steps to one request per output kind, as the engine core would (a sequence that a
    stop string ended gets no more tokens). Returns {kind: [RequestOutput...]} and the ids the
    processor asked to abort."""
    processor = OutputProcessor(tokenizer)
    for kind in KINDS:
        processor.add_request(kind.name, None, prompt_ids, params, [f"core-{kind.name}"], kind)
    outputs: dict[RequestOutputKind, list] = {kind: [] for kind in KINDS}
    aborted: list[str] = []
    for i, new_ids in enumerate(steps):
        last = i == len(steps) - 1
        core_outputs = [EngineCoreOutput(f"core-{kind.name}", new_ids, finish_reason if last else None)
                        for kind in KINDS if f"core-{kind.name}" not in aborted]
        results, to_abort = processor.process_outputs(core_outputs)
        aborted += to_abort
        for result in results:
            outputs[RequestOutputKind[result.request_id]].append(result)
    assert not processor.requests and not processor._child_to_parent  # every request finished
    return outputs, aborted


def check_consistent(outputs, expected_text: str) -> None:
    """DELTA pieces add up to the final text; CUMULATIVE only grows; FINAL_ONLY is one output."""
    deltas = outputs[RequestOutputKind.DELTA]
    cumulative = outputs[RequestOutputKind.CUMULATIVE]
    final_only = outputs[RequestOutputKind.FINAL_ONLY]
    assert len(final_only) == 1 and final_only[0].finished
    assert all(len(o.outputs) == 1 for kind in KINDS for o in outputs[kind])
    emitted = ""
    for out in deltas:
        emitted += out.outputs[0].text
        assert expected_text.startswith(emitted), (emitted, expected_text)
    assert emitted == expected_text
    previous = ""
    for out in cumulative:
        text = out.outputs[0].text
        assert text.startswith(previous) and expected_text.startswith(text)
        previous = text
    assert previous == expected_text == final_only[0].outputs[0].text
    assert [o.finished for o in deltas][-1] and not any(o.finished for o in deltas[:-1])
    token_ids = [t for out in deltas for t in out.outputs[0].token_ids]
    assert token_ids == final_only[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


# ------------------------------------------------------------------------------------ round trips

token_lists = st.lists(st.one_of(st.integers(3, 258), st.sampled_from(SPECIAL_IDS)), max_size=40)


@SETTINGS
@given(prompt=st.binary(max_size=6), body=st.binary(min_size=1, max_size=40),
       specials=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(SPECIAL_IDS)), max_size=3),
       sizes=st.lists(st.integers(1, 4), max_size=5), skip=st.booleans())
def test_random_bytes_round_trip(prompt, body, specials, sizes, skip):
    ids = ids_of(body)
    for position, special in specials:
        ids.insert(min(position, len(ids)), special)
    params = SamplingParams(skip_special_tokens=skip, max_tokens=None)
    outputs, aborted = run([BOS_ID] + ids_of(prompt), chunked(ids, sizes), params)
    expected = TOKENIZER.decode(ids, skip_special_tokens=skip)
    check_consistent(outputs, expected)
    assert aborted == []
    final = outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    assert final.finish_reason == "length" and final.stop_reason is None


@SETTINGS
@given(text=st.text(alphabet="aé€😀 \n\ufffd", min_size=1, max_size=20), sizes=st.lists(st.integers(1, 3), max_size=3))
def test_valid_utf8_round_trip(text, sizes):
    """Valid text (multi-byte characters, U+FFFD itself) comes back exactly."""
    ids = ids_of(text.encode())
    outputs, _ = run([BOS_ID], chunked(ids, sizes), SamplingParams(max_tokens=None))
    check_consistent(outputs, text)


def test_multibyte_characters_wait_for_their_last_byte():
    detok = IncrementalDetokenizer(TOKENIZER, [BOS_ID], SamplingParams())
    texts = []
    for token_id in ids_of("a€😀".encode()):
        detok.update([token_id], finished=False)
        texts.append(detok.text)
    assert texts == ["a", "a", "a", "a€", "a€", "a€", "a€", "a€😀"]


def test_invalid_utf8_is_replaced_as_a_full_decode_does():
    for data in [b"\xff", b"a\xe2\x82", b"\xe2\x82A", b"\xe2A\x82A", b"\x80\x80a", b"\xf0\x9f\x98\x80\xf0\x9f"]:
        ids = ids_of(data)
        outputs, _ = run([BOS_ID], [[t] for t in ids], SamplingParams())
        check_consistent(outputs, data.decode("utf-8", errors="replace"))
        assert TOKENIZER.decode(ids) == data.decode("utf-8", errors="replace")


def test_prompt_tail_split_character():
    """The prompt ends in the first bytes of a character and the output begins with the rest: the
    output is decoded on its own, as tokenizer.decode(output ids) does."""
    prompt = [BOS_ID] + ids_of(b"x\xe2\x82")
    ids = ids_of(b"\xac\xac abc")
    outputs, _ = run(prompt, [[t] for t in ids], SamplingParams())
    check_consistent(outputs, TOKENIZER.decode(ids))


@pytest.mark.parametrize("skip, expected", [(True, "ab"), (False, "<s>a</s><pad>b")])
def test_special_tokens_skipped_or_kept(skip, expected):
    ids = [BOS_ID, ids_of(b"a")[0], EOS_ID, PAD_ID, ids_of(b"b")[0]]
    outputs, _ = run([BOS_ID], [[t] for t in ids], SamplingParams(skip_special_tokens=skip))
    check_consistent(outputs, expected)
    assert TOKENIZER.decode(ids, skip_special_tokens=skip) == expected


def test_out_of_vocabulary_ids_do_not_break_decoding():
    ids = ids_of(b"ab") + [300] + ids_of(b"c")  # a model vocabulary padded past the tokenizer's
    outputs, _ = run([BOS_ID], [[t] for t in ids], SamplingParams())
    check_consistent(outputs, TOKENIZER.decode(ids))


# ------------------------------------------------------------------------------------ stop strings

def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Text grows a character at a time; the first time some stop strings end at the new character,
    the leftmost of them wins."""
    for end in range(1, len(text) + 1):
        found = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if found:
            start, stop = min(found)
            return (text[:start + len(stop)] if include else text[:start]), stop
    return text, None


stop_alphabet = "ab€😀 "


@SETTINGS
@given(text=st.text(alphabet=stop_alphabet, min_size=1, max_size=24),
       stops=st.lists(st.text(alphabet=stop_alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans(), sizes=st.lists(st.integers(1, 4), max_size=4))
def test_stop_strings_never_leak(text, stops, include, sizes):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    outputs, aborted = run([BOS_ID], chunked(ids_of(text.encode()), sizes), params)
    expected, stop = reference_stop(text, stops, include)
    check_consistent(outputs, expected)
    final = outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    if stop is None:
        assert (final.finish_reason, final.stop_reason) == ("length", None)
        assert aborted == []
    else:
        assert (final.finish_reason, final.stop_reason) == ("stop", stop)
        if not include:
            assert not any(s in final.text for s in stops)
        for out in outputs[RequestOutputKind.DELTA] + outputs[RequestOutputKind.CUMULATIVE]:
            assert out.outputs[0].stop_reason in (None, stop)


@settings(max_examples=40, deadline=None)
@given(prompt=st.binary(max_size=4), body=st.binary(min_size=1, max_size=16),
       stops=st.lists(st.sampled_from(["a", "\ufffd", "ab", "b\x00"]), max_size=2), include=st.booleans())
def test_tokenizer_without_decode_stream(prompt, body, stops, include):
    """Full decodes stand in for the stream: text still streams, is exact, and stops the same."""
    ids = ids_of(body)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    steps = [[t] for t in ids]
    fast, _ = run([BOS_ID] + ids_of(prompt), steps, params)
    slow, _ = run([BOS_ID] + ids_of(prompt), steps, params, tokenizer=SlowTokenizer())
    expected = fast[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    check_consistent(slow, expected.text)
    got = slow[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == (expected.finish_reason, expected.stop_reason)
    if not stops:
        assert expected.text == body.decode("utf-8", errors="replace")


def test_tokenizer_without_decode_stream_streams():
    outputs, _ = run([BOS_ID], [[t] for t in ids_of("ab€c".encode())], SamplingParams(),
                     tokenizer=SlowTokenizer())
    assert [o.outputs[0].text for o in outputs[RequestOutputKind.DELTA]] == ["a", "b", "", "", "€", "c"]


def test_stop_string_split_across_tokens_is_held_back():
    """'STOP' arrives one byte per step; the partial 'STO' that did not become a stop string is
    released later, the real one never is."""
    text = "abcSTOxyzSTOPtail"
    params = SamplingParams(stop=["STOP"])
    outputs, aborted = run([BOS_ID], [[t] for t in ids_of(text.encode())], params)
    check_consistent(outputs, "abcSTOxyz")
    deltas = [o.outputs[0].text for o in outputs[RequestOutputKind.DELTA]]
    assert "".join(deltas) == "abcSTOxyz" and not any("S" in d for d in deltas[-1:])
    assert sorted(aborted) == ["core-CUMULATIVE", "core-DELTA", "core-FINAL_ONLY"]
    final = outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    # the token that completed the stop string is the last one reported
    assert final.token_ids == ids_of(b"abcSTOxyzSTOP")


def test_stop_string_with_multibyte_characters():
    text = "x€😀y€😀z"
    params = SamplingParams(stop=["😀z", "€😀"], include_stop_str_in_output=True)
    outputs, _ = run([BOS_ID], [[t] for t in ids_of(text.encode())], params)
    check_consistent(outputs, "x€😀")
    assert outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0].stop_reason == "€😀"


def test_stop_string_found_in_final_reconciliation():
    """A stop string completed only by the full decode at the end (text held by the stream) still
    cuts the output."""
    ids = ids_of(b"ab\xef\xbf\xbd")  # ends in a real U+FFFD, which the stream holds back
    params = SamplingParams(stop=["b\ufffd"])
    outputs, _ = run([BOS_ID], [[t] for t in ids], params)
    check_consistent(outputs, "a")
    assert outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0].stop_reason == "b\ufffd"


def test_no_stop_check_before_min_tokens():
    params = SamplingParams(stop=["a"], min_tokens=3, max_tokens=10)
    outputs, _ = run([BOS_ID], [[t] for t in ids_of(b"aaxa")], params)
    check_consistent(outputs, "aax")


# ------------------------------------------------------------------------------------ n samples

def test_samples_joined_into_one_output():
    processor = OutputProcessor(TOKENIZER)
    params = SamplingParams(n=2)
    processor.add_request("r", "p", [BOS_ID], params, ["0_r", "1_r"], RequestOutputKind.FINAL_ONLY)
    a, b = ids_of(b"hi"), ids_of(b"yo!")
    assert processor.process_outputs([EngineCoreOutput("0_r", a[:1]), EngineCoreOutput("1_r", b[:1])]) == ([], [])
    results, _ = processor.process_outputs([EngineCoreOutput("1_r", b[1:], "stop", EOS_ID),
                                            EngineCoreOutput("0_r", a[1:2])])
    assert results == []
    results, _ = processor.process_outputs([EngineCoreOutput("0_r", [EOS_ID], "stop")])
    (result,) = results
    assert result.finished and [c.index for c in result.outputs] == [0, 1]
    assert [c.text for c in result.outputs] == ["hi", "yo!"]
    assert result.outputs[1].stop_reason == EOS_ID
    assert not processor.requests
