"""`bin/engine bench serve`'s client against a server that drops pooled connections.

cpp-httplib (llama-server's HTTP layer) closes keep-alive connections on its own schedule; a
request sent on one it has just closed gets "Server disconnected without sending a
response" and never reaches it. The bench sends such a request once more, so the baseline
server is not charged failures that are the client's. A request the server did answer is
never sent twice.
"""

from __future__ import annotations

import asyncio
import json

from actors.bench import serve

CHUNK = {"choices": [{"text": "ok"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
BODY = f"data: {json.dumps(CHUNK)}\n\ndata: {json.dumps(USAGE)}\n\ndata: [DONE]\n\n".encode()


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return True


def _server(answer_per_connection: int, drop_after_status: bool = False):
    """Answers `answer_per_connection` requests per connection, then reads the next one and
    closes the socket without a word (or, with `drop_after_status`, after the status line)."""
    seen = {"requests": 0}

    async def handle(reader, writer):
        try:
            for _ in range(answer_per_connection):
                await _read_request(reader)
                seen["requests"] += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
                    + BODY
                )
                await writer.drain()
            await _read_request(reader)
            seen["requests"] += 1
            if drop_after_status:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\ndata: ")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle, seen


async def _run(handler, requests: int) -> tuple[dict, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        args = serve.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--temperature", "0"])
        dataset = [serve.Request(prompt="hello", output_len=1) for _ in range(requests)]
        outcomes, duration = await serve.run_load(args, dataset, 1)
    return serve.summarize(outcomes, duration, 1), len(outcomes)


def test_a_request_on_a_connection_the_server_closed_is_sent_again():
    handler, seen = _server(answer_per_connection=2)
    summary, count = asyncio.run(_run(handler, requests=6))
    assert count == 6
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["output_tokens"] == 6
    # Connections answer 2 each and drop the 3rd: requests 3 and 5 were resent.
    assert summary["resent_after_stale_connection"] == 2
    assert seen["requests"] == 8


def test_a_request_the_server_began_answering_is_not_sent_again():
    handler, seen = _server(answer_per_connection=0, drop_after_status=True)
    summary, _ = asyncio.run(_run(handler, requests=1))
    assert summary["completed"] == 0 and summary["failed"] == 1
    assert summary["resent_after_stale_connection"] == 0
    assert seen["requests"] == 1


def test_tpot_counts_tokens_where_itl_counts_chunks():
    # Two requests of 9 tokens over 80 ms after their first: one streamed a token a chunk
    # (8 gaps of 10 ms), one four tokens a chunk (2 gaps of 40 ms): ITL differs, TPOT not.
    one = serve.Outcome(ok=True, ttft=0.05, e2e=0.13, itl=[0.01] * 8, output_tokens=9)
    four = serve.Outcome(ok=True, ttft=0.05, e2e=0.13, itl=[0.04] * 2, output_tokens=9)
    alone = serve.Outcome(ok=True, ttft=0.05, e2e=0.05, output_tokens=1)  # no gap at all
    summary = serve.summarize([one, four, alone], 1.0, 1)
    assert summary["tpot_s"]["p50"] == summary["tpot_s"]["p99"]
    assert abs(summary["tpot_s"]["mean"] - 0.01) < 1e-9
    assert len(summary["samples"]["tpot_s"]) == 2
    assert summary["itl_s"]["p99"] > 3 * summary["itl_s"]["p50"]
