"""Clients that close their streams mid-way abort their requests; the KV returns at once.

20 concurrent streaming requests (long max_tokens, EOS ignored) are each closed after a few
chunks. Within a second of the last close, /metrics must show no request running or
waiting and no KV page held by a request, and the pools must balance.
"""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from tests.e2e.engine_fixtures import natural_text
from tests.e2e.server_fixtures import (
    MODEL_NAME,
    NUM_PAGES,
    engine_figures,
    is_idle,
    scrape_metrics,
    wait_idle,
)

pytestmark = [pytest.mark.model]

STREAMS = 20
CHUNKS_BEFORE_CLOSE = 3
RELEASE_DEADLINE_S = 1.0


async def _open_and_leave(
    client: httpx.AsyncClient, auth: dict, prompt: str, chat: bool, closed_at: list[float]
) -> int:
    if chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt}
    body.update(model=MODEL_NAME, max_tokens=400, ignore_eos=True, temperature=0, stream=True)
    seen = 0
    async with client.stream("POST", path, json=body, headers=auth) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                seen += 1
                if seen >= CHUNKS_BEFORE_CLOSE:
                    break
    # Leaving the block before the body ended closes the connection.
    closed_at.append(time.monotonic())
    return seen


def test_closed_streams_abort_and_release_kv(server):
    idle, _ = wait_idle(server)
    before = scrape_metrics(server)
    text = natural_text()
    prompts = [text[i * 300 : i * 300 + 200] for i in range(STREAMS)]
    closed_at: list[float] = []

    async def run() -> None:
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(
            base_url=server.base_url, limits=limits, timeout=120.0
        ) as client:
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(prompts):
                    tg.start_soon(
                        _open_and_leave, client, server.auth, prompt, i % 2 == 1, closed_at
                    )

    anyio.run(run)
    assert len(closed_at) == STREAMS
    last_close = max(closed_at)
    while True:
        figures = engine_figures(server)
        waited = time.monotonic() - last_close
        if is_idle(figures) or waited > 10 * RELEASE_DEADLINE_S:
            break
        time.sleep(0.02)
    print(f"KV released {waited:.3f} s after the last close")
    assert is_idle(figures), f"still busy {waited:.2f} s after the last close: {figures}"
    assert waited < RELEASE_DEADLINE_S, f"KV came back only {waited:.2f} s after the last close"

    after = scrape_metrics(server)
    free = after['kvactor:kv_pages{state="free"}']
    tree = after['kvactor:kv_pages{state="tree"}']
    assert free + tree == NUM_PAGES and after['kvactor:kv_pages{state="held"}'] == 0
    aborted = 'kvactor:requests_total{outcome="aborted"}'
    assert after[aborted] == before[aborted] + STREAMS
    assert after["kvactor:kv_aborted_total"] >= before["kvactor:kv_aborted_total"] + STREAMS
    assert (
        after['kvactor:requests_total{outcome="success"}']
        == (before['kvactor:requests_total{outcome="success"}'])
    )
    # The engine still serves, and its held KV is back to the idle value.
    ok = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.auth,
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text
    final, _ = wait_idle(server)
    assert final['kvactor:kv_pages{state="held"}'] == idle['kvactor:kv_pages{state="held"}'] == 0
