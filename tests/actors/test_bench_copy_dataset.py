"""`bin/engine bench serve --dataset copy`: prompts whose natural continuation copies them.

Each prompt is a document (code-like or prose) of about `--input-len` tokens, a line asking
for it again, and the first line or two of that copy, so even a base model continues by
copying (what n-gram / prompt-lookup drafting is measured on). The prompts are the same for a
seed, and the client sends them to /v1/completions and reports the dataset by name.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from actors.bench import serve


@pytest.fixture(scope="module")
def source() -> serve.TextSource:
    return serve.TextSource(None)


def _tokens(source: serve.TextSource, text: str) -> int:
    return len(source.bundle.encode(text, add_special_tokens=False))


def _dataset(source, *extra: str) -> list[serve.Request]:
    return serve.build_dataset(serve.parse_args(["--dataset", "copy", *extra]), source)


def test_the_same_seed_gives_the_same_prompts(source):
    a = _dataset(source, "--num-prompts", "6", "--seed", "7", "--range-ratio", "0.5")
    b = _dataset(source, "--num-prompts", "6", "--seed", "7", "--range-ratio", "0.5")
    c = _dataset(source, "--num-prompts", "6", "--seed", "8", "--range-ratio", "0.5")
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(r.messages is None and r.prompt for r in a)  # completion-style, for base models


def test_each_prompt_holds_its_document_and_ends_on_the_start_of_its_copy(source):
    rng = random.Random(3)
    kinds = set()
    for _ in range(24):
        prompt, doc, copy = serve.copy_prompt(rng, source, 160)
        kinds.add(doc.startswith("def "))
        assert prompt.count(doc) == 1
        # The copy cue: after the document, an ask ("... again ...") and then the copy's first
        # line or two, whole lines; the rest of the copy is what the model is to produce.
        after = prompt[prompt.index(doc) + len(doc) :]
        assert "again" in after and prompt.endswith("\n")
        cue = after.split("\n\n")[-1].removeprefix("```python\n")
        assert cue.count("\n") in (1, 2) and copy.startswith(cue) and len(cue) < len(copy)
        # an edit (renamed function, changed number, replaced word) keeps the lines
        assert len(copy.split("\n")) == len(doc.split("\n"))
    assert kinds == {True, False}  # both code and prose documents


def test_document_lengths_follow_input_len(source):
    rng = random.Random(5)
    for n in (64, 256, 1024):
        sizes = [_tokens(source, serve.copy_prompt(rng, source, n)[1]) for _ in range(8)]
        assert all(0.7 * n <= s <= n for s in sizes), (n, sizes)
    # --range-ratio spreads the document lengths as it does the other datasets' prompts
    spread = _dataset(source, "--num-prompts", "12", "--input-len", "400", "--range-ratio", "0.5")
    sizes = [_tokens(source, r.prompt) for r in spread]
    assert min(sizes) < 330 and max(sizes) > 330
    assert all(140 <= s <= 400 + 80 for s in sizes), sizes  # + the ask and the cue
    fixed = _dataset(source, "--num-prompts", "4", "--output-len", "96")
    assert [r.output_len for r in fixed] == [96] * 4


def _fake_server(bodies: list[tuple[str, dict]]):
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(
                    int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:")
                )
                body = json.loads(await reader.readexactly(length))
                bodies.append((lines[0].split()[1].decode(), body))
                chunk = {"choices": [{"text": "    x = 1\n"}]}
                usage = {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 4}}
                data = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data.encode()
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


def test_the_client_sends_copy_prompts_to_completions_and_names_the_dataset(tmp_path):
    bodies: list[tuple[str, dict]] = []
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(_fake_server(bodies), "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "bench.json"
        code = serve.main(
            [
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--dataset",
                "copy",
                "--num-prompts",
                "3",
                "--input-len",
                "48",
                "--output-len",
                "8",
                "--max-concurrency",
                "2",
                "--output-json",
                str(out),
            ]
        )
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["dataset"] == "copy"
    [run] = doc["runs"]
    assert run["completed"] == 3 and run["failed"] == 0 and run["output_tokens"] == 12
    assert {path for path, _ in bodies} == {"/v1/completions"}
    assert all(b["max_tokens"] == 8 and "again" in b["prompt"] for _, b in bodies)
