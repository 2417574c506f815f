"""The program state's own rules, on a scripted backend (no model): role framing through a
template, fork variables and joins, and argument checks made where the program builds a call."""

from __future__ import annotations

import pytest
from jinja2 import Template

import kvtide.lang as kl
from kvtide.lang.backend import GenResult, Prompt, ScoreResult
from kvtide.lang.ops import Gen
from kvtide.models.demo import CHAT_TEMPLATE


class ScriptedBackend:
    """Generates "<name>#<number of calls so far>"; scores a choice by its length."""

    def __init__(self, template: str = CHAT_TEMPLATE) -> None:
        self.template = Template(template)
        self.prompts: list[str] = []

    def render_chat(self, messages):
        return self.template.render(messages=messages, bos_token="<s>", add_generation_prompt=False)

    def generate(self, prompts: list[Prompt], ops: list[Gen]):
        results = []
        for prompt, op in zip(prompts, ops, strict=True):
            self.prompts.append(prompt.text)
            results.append(GenResult(f"{op.name}#{len(self.prompts)}", None, {"seed": op.seed}))
        return results

    def generate_n(self, prompt: Prompt, op: Gen, n: int):
        self.prompts.append(prompt.text)
        return [GenResult(f"{op.name}#{len(self.prompts)}.{i}", None, {}) for i in range(n)]

    def score(self, prompt: Prompt, choices: list[str]) -> ScoreResult:
        return ScoreResult([[-1.0 / len(c)] * len(c) for c in choices])


def test_roles_follow_the_template_and_messages_match_the_text():
    backend = ScriptedBackend()

    @kl.function
    def chat(s):
        s += kl.system("Be brief.")
        s += kl.user(["Hi ", kl.gen("name")])
        s += kl.assistant(["Hello, ", kl.select("greeting", choices=["a", "friend"]), "!"])

    state = chat.run(backend=backend)
    assert state.text() == "<s><|system|>Be brief.\n<|user|>Hi name#1\n<|assistant|>Hello, friend!\n"
    assert state.text() == backend.render_chat(state.messages())
    assert backend.prompts == ["<s><|system|>Be brief.\n<|user|>Hi "]
    assert state["greeting"] == "friend"  # the mean logprob, not the sum, ranks the choices
    assert state.get_meta_info("greeting")["normalized_prompt_logprobs"] == [-1.0, -1.0 / 6]


def test_a_template_that_rewrites_earlier_messages_is_refused():
    rewriting = "{% for m in messages %}{{ loop.length }}:{{ m['content'] }};{% endfor %}"

    @kl.function
    def chat(s):
        s += kl.user("one")
        s += kl.user("two")

    with pytest.raises(ValueError, match="chat template"):
        chat.run(backend=ScriptedBackend(rewriting))


def test_fork_variables_are_readable_from_the_parent_and_join_gathers_them():
    backend = ScriptedBackend()

    @kl.function
    def tree(s):
        s += "Q:"
        s += kl.gen("root")
        forks = s.fork(2)
        for f in forks:
            f += kl.gen("leaf")
        s += "!"
        assert s["leaf"] == "leaf#3"  # the latest fork that set it
        assert forks[0]["root"] == s["root"]  # forks start with the parent's variables
        forks.join("concate_and_append")
        group = s.fork(3)
        group += kl.gen("twig", seed=4)

    state = tree.run(backend=backend)
    assert state["leaf"] == ["leaf#2", "leaf#3"]
    assert state.text() == "Q:root#1!leaf#2leaf#3"
    assert backend.prompts[1:3] == ["Q:root#1"] * 2
    assert state["twig"] == "twig#4.2"  # one request of three continuations
    assert state.variables()["twig"] == "twig#4.2"


def test_group_gen_on_diverged_forks_gives_each_fork_its_own_seed():
    backend = ScriptedBackend()
    parent = kl.ProgramState(backend)
    forks = parent.fork(3)
    for i, f in enumerate(forks):
        f += str(i)
    forks += kl.gen("x", seed=10)
    assert [f.get_meta_info("x")["seed"] for f in forks] == [10, 11, 12]
    assert [f.text() for f in forks] == ["0x#1", "1x#2", "2x#3"]


def test_calls_are_checked_where_the_program_builds_them():
    with pytest.raises(ValueError, match="at most one"):
        kl.gen("x", regex="a+", choices=["a"])
    with pytest.raises(ValueError, match="temperature"):
        kl.gen("x", temperature=-1.0)
    with pytest.raises(ValueError, match="choices"):
        kl.select("x", choices=[])
    with pytest.raises(ValueError, match="choices_method"):
        kl.select("x", choices=["a"], choices_method="greedy_token_selection")
    with pytest.raises(ValueError, match="backend"):
        kl.function(lambda s: None).run()
