"""`kvtide serve` flags, without starting anything."""

from __future__ import annotations

import pytest

from kvtide.cli import build_parser
from kvtide.engine.chat_template import read_chat_template


def test_serve_flags():
    args = build_parser().parse_args(["serve", "demo", "--port", "9000", "--api-key", "k", "--max-model-len", "512",
                                      "--max-waiting-requests", "3", "--served-model-name", "a", "b"])
    assert args.model_tag == "demo" and args.port == 9000 and args.host == "127.0.0.1"
    assert args.api_key == "k" and args.max_model_len == 512 and args.max_waiting_requests == 3
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve", "--model", "demo"]).model == "demo"


def test_serve_needs_one_model():
    from kvtide.cli import main

    assert main(["serve"]) == 2
    assert main(["serve", "a", "--model", "b"]) == 2
    assert main(["serve", "demo", "--max-request-body", "lots"]) == 2


def test_chat_template_from_file_or_string(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="chat-template"):
        read_chat_template("no-such-file.jinja")
