"""Structured output: constrain what a request may generate to a grammar (JSON schema, regex,
choice, EBNF, structural tag), compiled by xgrammar.

    frontend   validate.py     parse the constraint (no tokenizer): a bad one is a ValueError (400)
    core       manager.py      compile per (constraint, tokenizer) on a worker thread, cached; a
                               request waits in the queue until its grammar is ready
    scheduler  grammar.py      a matcher per request: accepts each emitted token, offers
                               jump-forward tokens (the continuation the grammar forces)
    runner     step.py         per step, the token bitmask of the constrained rows (drafts
                               checked against the grammar) applied to their logits in place;
                               under pipeline parallelism computed ahead in the core (StepBitmask)
"""
