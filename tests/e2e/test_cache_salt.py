"""vLLM's per-request `cache_salt` against a real server: requests share prefix-cache pages
only with requests of the same salt (issue 26, item 11).

Each test sends its own long prompt twice: with the same salt the second request is served
from the cache (`usage.prompt_tokens_details.cached_tokens` > 0); with another salt, or
none after a salted one, nothing is shared (0), so a tenant's TTFT and cached_tokens say
nothing about another tenant's prompts.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.engine_fixtures import natural_text
from tests.e2e.server_fixtures import MODEL_NAME, wait_idle

pytestmark = [pytest.mark.model]


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    figures, _ = wait_idle(server)
    assert figures['kvactor:kv_pages{state="held"}'] == 0


def _cached(server, path: str, prompt: str, salt: str | None) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of one request with `prompt` and `salt`."""
    body: dict = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(f"{server.base_url}{path}", json=body, headers=server.auth, timeout=120.0)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


# A distinct start per prompt: no other test (or parametrization) shares a prefix with it.
def _prompt(k: int) -> str:
    return f"[salt test {k}] " + natural_text()[1500 * k : 1500 * (k + 1)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_isolates_the_prefix_cache(server, path):
    k = 0 if path == "/v1/completions" else 4
    # The same salt twice: the second is served from the cache.
    prompt = _prompt(k)
    n, first = _cached(server, path, prompt, "tenant-a")
    assert n > 200 and first == 0
    _, second = _cached(server, path, prompt, "tenant-a")
    assert second > 0
    # Another salt: nothing shared with tenant-a's pages.
    _, other = _cached(server, path, prompt, "tenant-b")
    assert other == 0
    # No salt after salted ones: the unsalted cache holds nothing of this prompt.
    _, unsalted = _cached(server, path, prompt, None)
    assert unsalted == 0
    # ... and an unsalted request shares with unsalted ones only.
    _, unsalted_again = _cached(server, path, prompt, None)
    assert unsalted_again > 0
    _, salted_after = _cached(server, path, _prompt(k + 1), "tenant-a")
    assert salted_after == 0


def test_an_unsalted_prompt_is_not_shared_with_a_salted_request(server):
    prompt = _prompt(2)
    _, first = _cached(server, "/v1/completions", prompt, None)
    _, again = _cached(server, "/v1/completions", prompt, None)
    assert first == 0 and again > 0
    _, salted = _cached(server, "/v1/completions", prompt, "tenant-c")
    assert salted == 0


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_a_bad_cache_salt_is_a_400(server, salt):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
    resp = httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.auth, timeout=60.0
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "cache_salt"
