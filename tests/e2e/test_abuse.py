"""One client never stops, stalls or starves the others (issue 26), on the real server:

- `n = 16` with a regex whose compiled grammar is 9 MiB is served (the grammar reaches the
  runner once, by key, not 16 times inside a forward batch), and the engine serves on;
- a regex that compiles for seconds into tens of MiB is a 400 naming the limit it broke,
  while another client's stream goes on meanwhile;
- /tokenize refuses a 2 MB prompt at once (400) and returns token strings in one call.
The engine is idle (no KV held, no request record) after every test.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.e2e.server_fixtures import MODEL_NAME, wait_idle

pytestmark = [pytest.mark.model]

SLOW_REGEX = (
    "[b-j]{1,50}[g-t]{1,50}[a-q]{1,50}[d-z]{1,50}[c-k]{1,50}"
    "[h-w]{1,50}[b-r]{1,50}[e-y]{1,50}[a-m]{1,50}[f-u]{1,50}"
)


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    wait_idle(server)


def _post(server, path: str, body: dict, timeout: float = 300.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.auth, timeout=timeout)


def _completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **extra}


def test_sixteen_choices_of_a_big_grammar_are_served(server):
    resp = _post(
        server,
        "/v1/completions",
        _completion(
            "Letters:", 4, n=16, temperature=1.0, structured_outputs={"regex": "[a-z]{100000}"}
        ),
    )
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 16
    assert all(re.fullmatch("[a-z]*", c["text"]) for c in choices), choices
    after = _post(server, "/v1/completions", _completion("1, 2, 3,", 4, temperature=0))
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_a_grammar_over_the_limits_is_refused_while_others_stream(server):
    gaps: list[float] = []
    done = threading.Event()

    def stream() -> None:
        # One token a chunk (no speculative runs): its gaps are the steps'.
        body = _completion(
            "Count: 1, 2, 3,", 64, temperature=0, ignore_eos=True, stream=True, speculative=False
        )
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=body,
            headers=server.auth,
            timeout=300,
        ) as resp:
            last = time.monotonic()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        done.set()

    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    resp = _post(
        server, "/v1/completions", _completion("x", 4, structured_outputs={"regex": SLOW_REGEX})
    )
    refused_after = time.monotonic() - t0
    worker.join(timeout=300)
    assert done.is_set()
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "grammar_compile_timeout_s" in message or "grammar_max_bytes" in message, message
    assert refused_after < 30
    assert len(gaps) >= 60 and max(gaps[1:]) < 2.0, max(gaps[1:])  # never stalled for it


def test_tokenize_is_bounded_and_returns_token_strings(server):
    t0 = time.monotonic()
    resp = _post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "word " * 400_000})
    assert resp.status_code == 400, resp.text
    assert time.monotonic() - t0 < 3.0
    resp = _post(
        server,
        "/tokenize",
        {"model": MODEL_NAME, "prompt": "Hello, world", "return_token_strs": True},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body["token_strs"]) == body["count"] == len(body["tokens"])
