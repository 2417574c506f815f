"""The chat page at GET /: served as one self-contained file, driven in headless Chromium against
real servers (open, behind --api-key, and --no-ui).

The tiny checkpoint has random weights, so answers are noise, but the streaming is real; the page
runs at temperature 0, so every answer here is the same on every run. A screenshot of the page
(wide and narrow) is saved to $KVTIDE_TEST_ARTIFACTS, else <repo>/test-artifacts/.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import tempfile
from importlib import resources

import httpx
import pytest
from serve_helpers import API_KEY, MODEL_NAME, start_server, wait_idle, wait_ready

from kvtide.server.cli import register

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
REPO = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 60.0
"""Bound on every wait for the page (an answer of a few dozen tokens takes well under a second)."""
LONG_MODEL_LEN = 4096
"""The open server's context, so a long answer is still running when the test presses Stop."""


def _page_html() -> str:
    return resources.files("kvtide.server.ui").joinpath("chat.html").read_text(encoding="utf-8")


# ---- the file itself (no server, no browser) -----------------------------------------------------
def test_page_is_small_self_contained_and_shipped():
    html = _page_html()
    assert len(html.encode()) < 15 * 1024
    # Nothing fetched from elsewhere: no absolute or protocol-relative src/href/action, no CSS
    # import or url() of another host, no CDN.
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:[a-z]+:)?//""", html, re.I), "external reference"
    assert not re.search(r"""@import|url\(\s*["']?\s*(?:[a-z]+:)?//""", html, re.I)
    assert "//cdn" not in html and "http://" not in html and "https://" not in html
    # Model output reaches the DOM only as text.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "localStorage",
                 "sessionStorage", "document.cookie"):
        assert sink not in html, sink
    assert html.count("<script>") == 1  # the one inline script the Content-Security-Policy pins
    # Shipped as package data: a wheel's kvtide/server/ui carries the file.
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "*.html" in pyproject["tool"]["setuptools"]["package-data"]["kvtide.server.ui"]


def test_no_ui_flag():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve", "demo"]).enable_ui is True
    assert parser.parse_args(["serve", "demo", "--no-ui"]).enable_ui is False


# ---- servers and the browser ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(llama_dir, server):
    """Two servers started at once (they load in parallel), each stopped in the finally; behind
    --api-key, the session's shared `server`."""
    flags = {"open": (["--max-num-seqs", "4", "--max-model-len", str(LONG_MODEL_LEN)], None),
             "no_ui": (["--max-num-seqs", "4", "--no-ui"], None)}
    # The open server's steps take at least 10 ms, so the long answer the Stop test aborts cannot
    # finish (4,032 tokens in under 40 s) before the click reaches it, however fast decode gets.
    envs = {"open": {"KVTIDE_FAULT_INJECT": "sleep_s=0.01"}}
    handles = {}
    try:
        for name, (args, key) in flags.items():
            handles[name] = start_server(llama_dir, *args, api_key=key, env=envs.get(name))
        for handle in handles.values():
            wait_ready(handle)
        yield {**handles, "keyed": server}
    finally:
        codes = {name: handle.stop() for name, handle in handles.items()}
        logs = {name: handle.log()[-3000:] for name, handle in handles.items()}
        for handle in handles.values():
            os.unlink(handle.log_path)
    for name, code in codes.items():
        assert code == 0, logs[name]


@pytest.fixture(scope="module")
def driver():
    if not (os.path.exists(CHROMEDRIVER) and os.path.exists(CHROMIUM)):
        pytest.skip(f"headless Chromium tests need {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install "
                    f"chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[dev])")
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="kvtide-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        # The background-networking flags keep Chromium from reaching for the internet.
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                    "--window-size=1280,900"):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            yield browser
        finally:
            browser.quit()


def _wait(driver, condition, message: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message)


def _by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def _answers(driver) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def _set(driver, element_id: str, value: str) -> None:
    field = _by_id(driver, element_id)
    field.clear()
    field.send_keys(value)


def _open_page(driver, server) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(server.url("/"))


def _wait_model(driver) -> None:
    _wait(driver, lambda d: _by_id(d, "model").text == MODEL_NAME, "the page never showed the model name")


def _say(driver, text: str) -> dict:
    """Type `text`, press Send, wait until its answer is complete; the answer's text and stats."""
    count = len(_answers(driver))
    _set(driver, "input", text)
    _by_id(driver, "send").click()
    _wait(driver, lambda d: len(_answers(d)) == count + 1, "no assistant message appeared")
    answer = _answers(driver)[-1]
    stats = answer.find_element("css selector", ".stats")
    _wait(driver, lambda d: stats.get_attribute("data-completion-tokens"), "the answer never finished")
    return {"text": answer.find_element("css selector", ".text").get_property("textContent"),
            "stats": stats.text, **{key: stats.get_attribute("data-" + key) for key in
                                    ("ttft-ms", "tok-per-s", "prompt-tokens", "completion-tokens", "chunks")}}


def _screenshot(driver, name: str) -> pathlib.Path:
    directory = pathlib.Path(os.environ.get("KVTIDE_TEST_ARTIFACTS") or REPO / "test-artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    driver.save_screenshot(str(path))
    return path


def _prompt_tokens(server, messages: list[dict]) -> int:
    r = httpx.post(server.url("/tokenize"), json={"messages": messages}, headers=server.headers, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


# ---- the page against an open server -------------------------------------------------------------
def test_chat_streams_with_history_and_stats(servers, driver):
    server = servers["open"]
    driver.set_window_size(1280, 900)
    _open_page(driver, server)
    try:
        _wait_model(driver)
        _set(driver, "temperature", "0")
        _set(driver, "max-tokens", "24")
        first_q, second_q = "Hello, who are you?", "Tell me more."
        first = _say(driver, first_q)
        assert first["text"].strip(), first
        assert float(first["ttft-ms"]) > 0 and float(first["tok-per-s"]) > 0, first
        assert "TTFT" in first["stats"] and "tok/s" in first["stats"], first["stats"]
        # Streamed, not delivered at once: several content chunks were rendered as they came.
        assert int(first["chunks"]) > 1 and int(first["completion-tokens"]) > 1, first
        assert int(first["prompt-tokens"]) == _prompt_tokens(server, [{"role": "user", "content": first_q}])

        # The second turn sends the whole conversation: its prompt is exactly the three messages.
        second = _say(driver, second_q)
        assert second["text"].strip() and len(_answers(driver)) == 2
        history = [{"role": "user", "content": first_q}, {"role": "assistant", "content": first["text"]},
                   {"role": "user", "content": second_q}]
        assert int(second["prompt-tokens"]) == _prompt_tokens(server, history) > int(first["prompt-tokens"])

        # The page asked for no resource it does not have and ran without a script error (a
        # Content-Security-Policy violation would be logged here too).
        severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        wide = _screenshot(driver, "chat-page-wide.png")
    driver.set_window_size(420, 860)
    narrow = _screenshot(driver, "chat-page-narrow.png")
    assert wide.stat().st_size > 0 and narrow.stat().st_size > 0
    # Readable in a narrow window: nothing sticks out sideways.
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    driver.set_window_size(1280, 900)

    # "New chat" forgets the conversation: the first question again is a one-message prompt, and
    # at temperature 0 it gets the first answer again.
    _by_id(driver, "new-chat").click()
    assert not _answers(driver)
    again = _say(driver, first_q)
    assert again["prompt-tokens"] == first["prompt-tokens"] and again["text"] == first["text"]


def test_stop_aborts_the_stream(servers, driver):
    server = servers["open"]
    _open_page(driver, server)
    _wait_model(driver)
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", str(LONG_MODEL_LEN - 64))
    _set(driver, "input", "Write a very long story.")
    _by_id(driver, "send").click()
    _wait(driver, lambda d: _answers(d) and _answers(d)[-1].find_element("css selector", ".text")
          .get_property("textContent"), "no content streamed")
    _by_id(driver, "stop").click()
    stats = _answers(driver)[-1].find_element("css selector", ".stats")
    _wait(driver, lambda d: "stopped" in stats.text, "the answer was not marked stopped")
    assert int(stats.get_attribute("data-completion-tokens")) < LONG_MODEL_LEN - 64
    assert _by_id(driver, "send").is_enabled() and not _by_id(driver, "stop").is_enabled()
    # The fetch was aborted, so the server saw the client go and aborted the request.
    assert wait_idle(server)["num_unfinished_requests"] == 0


# ---- behind --api-key ----------------------------------------------------------------------------
def test_page_open_without_key_and_asks_for_it(servers, driver):
    server = servers["keyed"]
    r = httpx.get(server.url("/"), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert API_KEY not in r.text
    assert "script-src 'sha256-" in r.headers["content-security-policy"]
    # Only GET / is open: the API, and other methods on /, still want the key.
    assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 401
    assert httpx.post(server.url("/"), json={}, timeout=30).status_code == 401

    _open_page(driver, server)
    key_row = _by_id(driver, "key-row")
    _wait(driver, lambda d: key_row.is_displayed(), "the page did not ask for the API key")
    assert "401" in _by_id(driver, "error").text
    # Sending before the key shows the server's error and gives the text back for a retry.
    _set(driver, "input", "Hi")
    _by_id(driver, "send").click()
    error = _by_id(driver, "error")
    _wait(driver, lambda d: "Invalid or missing API key" in error.text, "the 401 was not shown")
    assert not _answers(driver) and _by_id(driver, "input").get_property("value") == "Hi"

    _set(driver, "api-key", API_KEY)
    _by_id(driver, "use-key").click()
    _wait_model(driver)
    assert not error.is_displayed()
    # The key is only in a JS variable: not in the field, the DOM, storage or cookies.
    assert _by_id(driver, "api-key").get_property("value") == ""
    assert API_KEY not in driver.page_source
    assert driver.execute_script("return localStorage.length + sessionStorage.length") == 0
    assert driver.execute_script("return document.cookie") == ""

    # A request the server refuses (400, over the context) is shown, not swallowed.
    _set(driver, "max-tokens", "100000")
    _by_id(driver, "send").click()
    _wait(driver, lambda d: "Error 400" in error.text and "maximum context length" in error.text,
          "the 400 was not shown")

    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "16")
    answer = _say(driver, "Hi")
    assert answer["text"].strip() and float(answer["ttft-ms"]) > 0, answer
    assert not error.is_displayed()


# ---- --no-ui -------------------------------------------------------------------------------------
def test_no_ui_serves_no_page_but_the_api(servers):
    server = servers["no_ui"]
    r = httpx.get(server.url("/"), timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error" and r.json()["error"]["message"]
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

