"""Speculative method name -> its Proposer class, imported when first asked for (a method's models
and kernels load only when it is configured).

The names are SpeculativeConfig's methods (spec_decode/config.py METHODS), which rejects any other
name at startup, before a model loads.
"""

from __future__ import annotations

import importlib

from kvtide.spec_decode.proposer import Proposer

PROPOSERS: dict[str, str] = {
    "ngram": "kvtide.spec_decode.ngram:NgramProposer",
    "draft_model": "kvtide.spec_decode.draft_proposer:DraftModelProposer",
    "layer_skip": "kvtide.spec_decode.draft_proposer:LayerSkipProposer",
    "medusa": "kvtide.spec_decode.medusa_proposer:MedusaProposer",
    "eagle": "kvtide.spec_decode.eagle_proposer:EagleProposer",
    "eagle3": "kvtide.spec_decode.eagle_proposer:EagleProposer",
}
"""method -> "module:class"."""


def proposer_class(method: str) -> type[Proposer]:
    """The class implementing `method`; ValueError for a name no class implements."""
    if method not in PROPOSERS:
        raise ValueError(f"speculative method {method!r} is not available in this build; "
                         f"available: {', '.join(PROPOSERS)}")
    module, _, name = PROPOSERS[method].partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, Proposer), f"{PROPOSERS[method]} is not a Proposer"
    return cls
