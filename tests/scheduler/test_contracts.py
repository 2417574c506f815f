"""The scheduler <-> runner contract (scheduler/output.py) is fully typed, and the objects that
ride on it (structured output's grammar, a KV connector's metadata and report) are what the
contract declares, on both sides of the wire."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from types import SimpleNamespace

import torch

from kvtide.disagg import p2p, tiered
from kvtide.disagg.base import KVConnectorScheduler
from kvtide.scheduler import output
from kvtide.scheduler.output import (
    ExpertLoad,
    GrammarMasker,
    KVConnectorMetadata,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TopLogprobs,
)
from kvtide.structured_output.manager import StructuredOutputManager
from kvtide.structured_output.step import StepBitmask
from kvtide.worker.wire import runner_output_from_wire, runner_output_to_wire

_BARE = (dict, list, set, frozenset, tuple)


def _loose_parts(tp) -> list[str]:
    """The parts of a type annotation that say nothing: Any, object, or a container without
    its element types."""
    if tp is typing.Any or tp is object or tp in _BARE:
        return [repr(tp)]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _BARE and not args:  # typing.Dict and friends, unparameterized
        return [repr(tp)]
    return [loose for arg in args if arg is not Ellipsis for loose in _loose_parts(arg)]


def _contract_parts(tp, seen: set) -> None:
    """Every dataclass and TypedDict of the contract module reachable from `tp`'s fields."""
    for arg in typing.get_args(tp):
        _contract_parts(arg, seen)
    if isinstance(tp, type) and tp.__module__ == output.__name__ and tp not in seen \
            and (dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)):
        seen.add(tp)
        for hint in typing.get_type_hints(tp).values():
            _contract_parts(hint, seen)


def test_every_contract_field_has_a_concrete_type():
    parts: set = set()
    for root in (SchedulerOutput, ModelRunnerOutput):
        _contract_parts(root, parts)
    assert {output.NewRequestData, output.CachedRequestData, TopLogprobs, ExpertLoad, KVConnectorOutput,
            KVConnectorMetadata} <= parts
    loose = {f"{part.__name__}.{name}: {bad}" for part in parts
             for name, hint in typing.get_type_hints(part).items() for bad in _loose_parts(hint)}
    for method in ("check_drafts", "apply"):
        hints = typing.get_type_hints(getattr(GrammarMasker, method), {"torch": torch})
        loose |= {f"GrammarMasker.{method}.{name}: {bad}" for name, hint in hints.items()
                  for bad in _loose_parts(hint)}
    assert loose == set()


class _RowGrammar:
    """A matcher whose next-token bitmask is given (the step asks only for the fill)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = self.words
        return True


def test_the_grammar_objects_the_runner_receives_are_grammar_maskers():
    vocab = 40
    words = torch.tensor([0b1011, 1 << 3], dtype=torch.int32)  # tokens 0, 1, 3 and 35 allowed
    manager = StructuredOutputManager(lambda: None, vocab)
    constrained = SimpleNamespace(request_id="c", grammar=_RowGrammar(words), all_token_ids=[5, 6])
    free = SimpleNamespace(request_id="f", grammar=None, all_token_ids=[7])
    in_core = manager.grammar_step([free, constrained])
    across_pipeline = StepBitmask.from_wire(in_core.ahead({}, None).to_wire())

    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    expected[1, [t for t in range(vocab) if t not in (0, 1, 3, 35)]] = float("-inf")
    for masker in (in_core, across_pipeline):
        assert isinstance(masker, GrammarMasker)
        for method in ("check_drafts", "apply"):
            declared = list(inspect.signature(getattr(GrammarMasker, method)).parameters)
            assert list(inspect.signature(getattr(masker, method)).parameters) == declared[1:], method
        masked = logits.clone()
        masker.apply(masked, [("f", 1), ("c", 1)])
        assert torch.equal(masked, expected)


def test_every_connector_hands_its_worker_kv_connector_metadata():
    schedulers = [cls for module in (tiered, p2p) for cls in vars(module).values()
                  if isinstance(cls, type) and issubclass(cls, KVConnectorScheduler) and cls is not KVConnectorScheduler]
    assert schedulers
    for cls in schedulers:
        returns = typing.get_type_hints(cls.build_connector_meta)["return"]
        assert issubclass(returns, KVConnectorMetadata), cls.__name__
    step = SchedulerOutput([], [], {}, 0)
    assert isinstance(tiered.TieredScheduler(None, None).build_connector_meta(step, {}), KVConnectorMetadata)


def test_runner_output_crosses_the_wire_with_its_typed_parts():
    top = TopLogprobs(-0.5, 2, [4, 9], [-0.25, -0.5])
    sent = ModelRunnerOutput(
        sampled_token_ids={"a": 9, "b": 3}, logprobs={"a": top}, prompt_logprobs={"b": [top, top]},
        failed={"c": "non-finite logits"}, spec_token_ids={"a": [1, 2]}, spec_logprobs={"a": [top, None]},
        num_draft_tokens={"a": 3}, kv_block_mass={"b": [1.5, 0.25]},
        kv_connector_output=KVConnectorOutput({"d", "e"}),
        expert_load=ExpertLoad(layers=[1, 3], tokens=[[2, 0], [1, 1]], dropped=[[0, 0], [0, 1]]))
    received = runner_output_from_wire(runner_output_to_wire(sent))
    assert received == sent
    assert isinstance(received.kv_connector_output, KVConnectorOutput)
    assert isinstance(received.logprobs["a"], TopLogprobs)
