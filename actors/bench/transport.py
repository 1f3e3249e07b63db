"""Micro-benchmark of the transport layer (not a test): ``python -m actors.bench.transport``.

Prints:

* the median (and p99) round-trip time of one small call (``Ping`` -> ``Pong``, encoded and
  decoded with the codec on both sides) through a ``ClientChannel``/``ServerChannel`` pair over
  inproc, ipc and tcp; for ipc and tcp both with the server in this process and in a spawned
  child process (the placement the multi-process engine uses);
* the encode and decode time of a 256-request ``transport.messages.runner.ForwardBatchMsg``
  (the per-step batch message) shaped like a steady decode step: every required list field,
  nested ones included, holds 256 entries; optional fields keep their defaults.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from actors.bench.timing import Timings, time_calls, time_calls_async
from transport.address import IpcDirectory, endpoint_for, new_system_id
from transport.channel import ClientChannel, ServerChannel
from transport.codec import Codec, DecodeFailure
from transport.messages.base import Message
from transport.messages.control import Ping, Pong

_REQUESTS_PER_BATCH = 256


# --- round trips ---------------------------------------------------------------------------


async def _serve_pongs(server: ServerChannel) -> None:
    codec: Codec[Ping] = Codec(Ping)
    reply_codec: Codec[Pong] = Codec(Pong)
    pid = os.getpid()
    while True:
        incoming = await server.recv()
        if isinstance(codec.decode(incoming.payload), DecodeFailure):
            continue
        reply = reply_codec.encode(Pong(actor="bench", pid=pid, uptime_s=0.0))
        server.reply(incoming.peer, incoming.envelope.request_id, reply)


def _child_server(address: str, ready: Any, stop: Any) -> None:
    async def run() -> None:
        server = ServerChannel(address)
        ready.set()
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_serve_pongs, server)
            while not stop.is_set():
                await anyio.sleep(0.05)
            task_group.cancel_scope.cancel()
        server.close()

    anyio.run(run)


async def _time_calls(address: str, calls: int) -> Timings:
    client = ClientChannel(address, sender="bench")
    codec: Codec[Pong] = Codec(Pong)
    ping = codec.encode(Ping())

    async def call() -> None:
        reply = codec.decode(await client.call(ping, timeout=10))
        assert isinstance(reply, Pong)

    try:
        # warm-up: connection set-up, first allocations
        return await time_calls_async(call, calls, warmup=calls // 10)
    finally:
        client.close()


async def _round_trip_in_process(address: str, calls: int) -> Timings:
    server = ServerChannel(address)
    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_serve_pongs, server)
            samples = await _time_calls(server.address, calls)
            task_group.cancel_scope.cancel()
    finally:
        server.close()
    return samples


async def _round_trip_cross_process(address: str, calls: int) -> Timings:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    child = context.Process(target=_child_server, args=(address, ready, stop), daemon=True)
    child.start()
    try:
        if not await anyio.to_thread.run_sync(ready.wait, 30.0):
            raise RuntimeError("benchmark server process did not start")
        return await _time_calls(address, calls)
    finally:
        stop.set()
        await anyio.to_thread.run_sync(child.join, 5.0)
        if child.is_alive():
            child.kill()


async def _round_trips(calls: int) -> None:
    system_id = new_system_id()
    with IpcDirectory(system_id):
        cases: list[tuple[str, Callable[[str, int], Any], str]] = [
            ("inproc, same process", _round_trip_in_process, "inproc"),
            ("ipc,    same process", _round_trip_in_process, "ipc"),
            ("tcp,    same process", _round_trip_in_process, "tcp"),
            ("ipc,    cross-process", _round_trip_cross_process, "ipc"),
            ("tcp,    cross-process", _round_trip_cross_process, "tcp"),
        ]
        print(f"call round trip (Ping -> Pong, {calls} calls, one caller):")
        for index, (label, runner, transport) in enumerate(cases):
            address = endpoint_for(f"bench{index}", transport, system_id)  # type: ignore[arg-type]
            samples = await runner(address, calls)
            print(f"  {label}: {samples.summary_us()}")


# --- batch message codec -------------------------------------------------------------------


def _sample_value(info: msgspec.inspect.Type, count: int) -> Any:
    inspect = msgspec.inspect
    if isinstance(info, (inspect.ListType, inspect.VarTupleType)):
        return [_sample_item(info.item_type, i) for i in range(count)]
    if isinstance(info, inspect.UnionType):
        concrete = [t for t in info.types if not isinstance(t, inspect.NoneType)]
        return _sample_value(concrete[0], count) if concrete else None
    if isinstance(info, inspect.StructType):
        return _sample_struct(info, count)
    return _sample_item(info, 0)


def _sample_item(info: msgspec.inspect.Type, index: int) -> Any:
    inspect = msgspec.inspect
    if isinstance(info, inspect.BoolType):
        return index % 2 == 0
    if isinstance(info, inspect.IntType):
        return (index * 7919) % 150_000
    if isinstance(info, inspect.FloatType):
        return 0.5 + index
    if isinstance(info, inspect.StrType):
        return f"req-{index}"
    if isinstance(info, inspect.BytesType):
        return bytes(8)
    if isinstance(info, inspect.LiteralType):
        return info.values[0]
    if isinstance(info, inspect.EnumType):
        return next(iter(info.cls))
    if isinstance(info, inspect.DictType):
        return {}
    if isinstance(info, (inspect.ListType, inspect.VarTupleType, inspect.UnionType)):
        return _sample_value(info, 4)
    if isinstance(info, inspect.StructType):
        return _sample_struct(info, 4)
    if isinstance(info, inspect.NoneType):
        return None
    raise TypeError(f"no sample value for {info!r}")


def _sample_struct(
    info: msgspec.inspect.StructType, count: int, *, skip_optional: bool = False
) -> Any:
    values = {
        field.name: _sample_value(field.type, count)
        for field in info.fields
        if field.required or not skip_optional
    }
    return info.cls(**values)


def _count_ints(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count_ints(item) for item in value)
    if isinstance(value, msgspec.Struct):
        return sum(_count_ints(getattr(value, f)) for f in value.__struct_fields__)
    return 0


def _median_us(function: Callable[[], object], repeats: int) -> float:
    return time_calls(function, repeats, warmup=0).median * 1e6


def _batch_codec(repeats: int) -> None:
    try:
        from transport.messages.runner import ForwardBatchMsg
    except ImportError as exc:
        print(f"batch codec: skipped ({exc})")
        return
    batch_type: type[Message] = ForwardBatchMsg
    # A steady decode step: every required list holds one entry per request (nested structs
    # such as the slot deltas too); optional per-admission fields keep their empty defaults.
    batch = _sample_struct(
        msgspec.inspect.type_info(batch_type), _REQUESTS_PER_BATCH, skip_optional=True
    )
    codec: Codec[Message] = Codec(batch_type)
    data = codec.encode(batch)
    assert codec.decode(data) == batch
    encode_us = _median_us(lambda: codec.encode(batch), repeats)
    decode_us = _median_us(lambda: codec.decode(data), repeats)
    print(
        f"batch codec ({batch_type.__name__}, {_REQUESTS_PER_BATCH} requests, "
        f"{_count_ints(batch)} ints, {len(data)} bytes):"
    )
    print(f"  encode median {encode_us:7.1f} us   decode median {decode_us:7.1f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m actors.bench.transport", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per transport")
    parser.add_argument("--repeats", type=int, default=2000, help="codec timing repeats")
    args = parser.parse_args(argv)
    anyio.run(_round_trips, args.calls)
    _batch_codec(args.repeats)


if __name__ == "__main__":
    main()
