"""`kvtide chat` end to end: real processes on the tiny Llama, through a pipe and a pseudo-terminal.

Greedy answers are checked against `LLM.chat` on the same history, so a conversation that lost
a turn, or rendered it differently, fails."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import termios
import time

import pytest

from kvtide import LLM, SamplingParams
from kvtide.chat.cli import escape_line
from kvtide.chat.session import ChatSession

CHAT = [sys.executable, "-m", "kvtide.cli", "chat"]
SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "256"]
GREEDY = ["--temperature", "0", "--max-tokens", "8"]
PROCESS_TIMEOUT_S = 60


def _env() -> dict:
    # Answers of a random model hold any character: write them as UTF-8 whatever the locale.
    return dict(os.environ, PYTHONIOENCODING="utf-8", TERM="dumb")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, max_model_len=256, kv_cache_memory="64MiB")


def _greedy_chat(llm, messages: list[dict], max_tokens: int = 8, **kwargs) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return llm.chat(messages, params)[0].outputs[0].text


def _offline_conversation(llm, user_messages: list[str], system: str | None = None) -> list[str]:
    """The answers LLM.chat gives when each turn carries all the earlier ones."""
    history = [{"role": "system", "content": system}] if system is not None else []
    answers = []
    for content in user_messages:
        history.append({"role": "user", "content": content})
        answer = _greedy_chat(llm, history)
        history.append({"role": "assistant", "content": answer})
        answers.append(answer)
    return answers


def _unescape_line(line: str) -> str:
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\":
            out.append({"n": "\n", "r": "\r", "\\": "\\"}[line[i + 1]])
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def _run_pipe(model_dir: str, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CHAT, "--model", model_dir, *GREEDY, *SMALL_ENGINE, *flags], input=stdin.encode(),
                          capture_output=True, timeout=PROCESS_TIMEOUT_S, env=_env())


def _answer_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    text = result.stdout.decode("utf-8")
    assert text.endswith("\n")
    return [_unescape_line(line) for line in text[:-1].split("\n")]


def test_escape_line_round_trips():
    text = "a\\nb\nc\r\n\\"
    line = escape_line(text)
    assert "\n" not in line and "\r" not in line
    assert _unescape_line(line) == text


def test_pipe_answers_carry_the_history(llm, llama_dir):
    messages = ["Hello there", "What did I just say?", "Tell me more"]
    expected = _offline_conversation(llm, messages)
    # Without the history the second message gets another answer: the check below can tell.
    assert expected[1] != _greedy_chat(llm, [{"role": "user", "content": messages[1]}])
    result = _run_pipe(llama_dir, "\n".join(messages) + "\n")
    assert _answer_lines(result) == expected
    assert not result.stdout.startswith(b"kvtide chat") and b">>>" not in result.stdout


def test_pipe_reset_keeps_the_system_message(llm, llama_dir):
    system = "You answer briefly."
    first, second = "Hello there", "What did I just say?"
    expected = _offline_conversation(llm, [first, second], system=system)
    after_reset = _offline_conversation(llm, [second], system=system)[0]
    assert after_reset != expected[1]
    # Empty and blank lines are skipped; /reset writes nothing.
    result = _run_pipe(llama_dir, f"{first}\n\n   \n{second}\n/reset\n{second}\n/exit\nnever sent\n",
                       "--system", system)
    assert _answer_lines(result) == [*expected, after_reset]


def test_interrupted_answer_is_kept_and_frees_its_blocks(llm):
    """What Ctrl-C does in the session: the answer stops after the current step, what was shown
    stays in the history, no KV block stays held, and the next turn reuses the cached prefix."""
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True))
    pieces: list[str] = []

    def on_text(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            session.interrupt()

    result = session.send("Tell me a long story", on_text)
    assert result.interrupted and result.finish_reason == "abort"
    assert result.num_output_tokens < 10 and result.text == "".join(pieces)
    assert session.history == [{"role": "user", "content": "Tell me a long story"},
                               {"role": "assistant", "content": result.text}]
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0

    short = SamplingParams(temperature=0, max_tokens=8)
    session.params = short
    follow_up = session.send("Go on")
    expected = llm.chat(session.messages[:-1], short)[0].outputs[0].text
    assert follow_up.text == expected and follow_up.finish_reason == "length"
    # The first turn's prompt came from the prefix cache (whole 16-token blocks of it).
    assert follow_up.num_cached_tokens >= (result.num_prompt_tokens // 16) * 16 > 0


# ---- a pseudo-terminal: what a person at the keyboard sees ------------------------------------

def _take_terminal() -> None:
    """In the child, after setsid: make the pty (its stdin) the controlling terminal, so that
    Ctrl-C typed into it sends SIGINT, and take SIGINT's default action back, as a shell does for
    a job in the foreground (a background job's children inherit it ignored)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Terminal:
    def __init__(self, args: list[str]) -> None:
        master, slave = os.openpty()
        self.fd = master
        self.buffer = b""
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=_env(),
                                     start_new_session=True, preexec_fn=_take_terminal)
        os.close(slave)

    def _read(self, deadline: float) -> bool:
        # poll, not select: a pytest-xdist worker that ran many tests may hold descriptors past 1024
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            return False
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            raise AssertionError(f"the chat exited (status {self.proc.poll()}); it wrote {self.buffer!r}")
        self.buffer += data
        return True

    def expect(self, pattern: bytes, timeout: float) -> bytes:
        """Everything up to and including the next `pattern`, consumed."""
        deadline = time.monotonic() + timeout
        while pattern not in self.buffer:
            if time.monotonic() >= deadline or not self._read(deadline):
                if time.monotonic() >= deadline:
                    raise AssertionError(f"no {pattern!r} in {timeout} s; got {self.buffer!r}")
        head, _, self.buffer = self.buffer.partition(pattern)
        return head + pattern

    def wait_for_bytes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.buffer) < count:
            if not self._read(deadline) and time.monotonic() >= deadline:
                raise AssertionError(f"fewer than {count} bytes in {timeout} s; got {self.buffer!r}")

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.fd)


def test_terminal_streams_and_ctrl_c_stops_only_the_answer(llm, llama_dir):
    story = "Tell me a long story"
    # The answer the request would give without Ctrl-C: until the context (256 tokens) is full.
    full = _greedy_chat(llm, [{"role": "user", "content": story}], max_tokens=100000, ignore_eos=True)
    assert len(full) > 150
    term = _Terminal([*CHAT, "--model", llama_dir, "--temperature", "0", "--max-tokens", "100000",
                      "--ignore-eos", *SMALL_ENGINE])
    try:
        banner = term.expect(b">>> ", timeout=PROCESS_TIMEOUT_S)
        assert b"kvtide chat" in banner and b"/reset" in banner and b"/exit" in banner

        term.send(story.encode() + b"\r")
        term.expect(story.encode(), timeout=10)  # the terminal's echo
        term.expect(b"\n", timeout=10)
        term.wait_for_bytes(3, timeout=30)  # the answer is streaming
        term.send(b"\x03")
        partial = term.expect(b">>> ", timeout=30).decode("utf-8", errors="replace")
        assert len(partial) < len(full) // 2, "Ctrl-C did not stop the answer"

        # The session goes on: the next answer runs to the end of the context, then the prompt.
        term.send(b"And then?\r")
        term.expect(b"And then?", timeout=10)
        answer = term.expect(b">>> ", timeout=PROCESS_TIMEOUT_S).decode("utf-8", errors="replace")
        assert "(answer cut after" in answer
        assert len(answer.split("(answer cut after")[0].strip()) > 20

        term.send(b"/exit\r")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()


@pytest.mark.parametrize(("key", "status"), [(b"\x03", 130), (b"\x04", 0)], ids=["ctrl-c", "ctrl-d"])
def test_terminal_leaves_at_the_prompt(llama_dir, key, status):
    term = _Terminal([*CHAT, "--model", llama_dir, *SMALL_ENGINE])
    try:
        term.expect(b">>> ", timeout=PROCESS_TIMEOUT_S)
        # Python's readline loop sees a signal only while it waits in select(); the prompt is
        # written just before. No person types faster than this pause.
        time.sleep(0.5)
        term.send(key)
        assert term.proc.wait(timeout=30) == status
    finally:
        term.close()


# ---- refusals: one line on stderr, exit status 2 ----------------------------------------------

def test_model_without_chat_template_is_refused(llama_dir, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(llama_dir, plain, ignore=shutil.ignore_patterns("chat_template.jinja"))
    result = subprocess.run([*CHAT, "--model", str(plain), *SMALL_ENGINE], input=b"hello\n",
                            capture_output=True, timeout=PROCESS_TIMEOUT_S, env=_env())
    assert result.returncode == 2 and result.stdout == b""
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "no chat template" in lines[0] and lines[0].startswith("kvtide chat: error:")


def test_chat_template_flag_serves_a_model_without_one(llm, llama_dir, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(llama_dir, plain, ignore=shutil.ignore_patterns("chat_template.jinja"))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    (tmp_path / "t.jinja").write_text(template)
    answers = _answer_lines(_run_pipe(str(plain), "hello\n", "--chat-template", str(tmp_path / "t.jinja")))
    expected = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=8),
                        chat_template=template)[0].outputs[0].text
    assert answers == [expected]
    assert expected != _greedy_chat(llm, [{"role": "user", "content": "hello"}])  # the template mattered


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "-1"], "temperature"),
    (["--system", "  "], "--system"),
    (["--chat-template", "no-such-template.jinja"], "--chat-template"),
])
def test_bad_flags_are_refused_before_the_model_loads(tmp_path, flags, message):
    # A model directory that does not exist: refusing the flag must not need it.
    result = subprocess.run([*CHAT, "--model", str(tmp_path / "absent"), *flags], input=b"hello\n",
                            capture_output=True, timeout=PROCESS_TIMEOUT_S, env=_env())
    assert result.returncode == 2 and result.stdout == b""
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("kvtide chat: error:")


def test_readme_first_command_answers_with_the_real_model(smollm2_gguf, tmp_path):
    """The README's first command, after the install: SmolLM2 from its wheel, through a pipe, two
    turns (the second needs the first to make sense)."""
    env = dict(_env(), KVTIDE_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([*CHAT, "--model", "smollm2", "--temperature", "0", "--max-tokens", "32"],
                            input=b"What is the capital of France?\nAnd of Italy?\n", capture_output=True,
                            timeout=180, env=env)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    first, second = result.stdout.decode("utf-8").splitlines()
    assert "Paris" in first
    assert "Rome" in second
