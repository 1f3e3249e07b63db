"""The ZeroMQ client protocol: frames between external clients and the engine's endpoint.

Transport
---------
The engine binds a ZeroMQ ROUTER socket (`bin/engine serve --zmq tcp://127.0.0.1:5557`,
actor `actors.frontends.zmq_endpoint.ZmqEndpointActor`). A client connects a DEALER socket to it
(`transport.client.KvactorClient` does this) and exchanges single-frame messages:

    client -> engine   [payload]          (the ROUTER sees [client identity, payload])
    engine -> client   [payload]

A REQ socket does not fit (it adds an empty delimiter frame and allows one request at a
time); use DEALER. Every payload is one msgpack map: a tagged msgspec Struct whose tag
field `type` is the class name, e.g. `{"type": "ClientSubmit", "request_id": "r1", ...}`.
Decoding is strict: an unknown tag, an unknown field, a missing required field or a wrong
type is refused.
Payloads above `MAX_CLIENT_FRAME_BYTES` are refused. A client may keep many requests in
flight on one socket; every engine frame names the client's `request_id`.

Client -> engine
----------------
`ClientSubmit`  start a generation. Exactly one of `prompt` (text), `prompt_ids` (token
                ids) or `messages` (chat turns, rendered with the model's chat template).
                `params` are the engine's `GenerationParams` (validated by the engine:
                max_tokens >= 1, temperature in [0, 2], ...). `stream=True`: one
                `ClientChunk` per engine step; `stream=False`: a single final `ClientChunk`
                holding the whole text. `request_id` is chosen by the client and must be
                unique among that client's live requests.
`ClientAbort`   end a live request. The engine answers with a final `ClientChunk` whose
                `finish_reason` is "abort" (unknown ids are ignored).
`ClientSession` open (`op="open"`, optional `ttl_s`, `max_tokens`), inspect (`"get"`),
                close (`"close"`), offload (`"offload"`: its KV to the host tier now) or
                prefetch (`"prefetch"`: its KV back into the pool now) a
                streaming session; answered by one `ClientSessionInfo`
                (or a `ClientError`) naming the frame's `request_id`. A `ClientSubmit` with
                `session_id` is a turn of that session: its prompt is the whole
                conversation, and the KV the session kept from the last turn serves the
                common prefix. One turn at a time per session ("session_busy" otherwise).
                A session belongs to the API key of the frame that opened it: under any
                other key it does not exist ("session_not_found"), on HTTP as here.

Engine -> client
----------------
`ClientChunk`   output of one request: new `text`, new `token_ids`, per-token `logprobs`
                when asked for. The last chunk of a request has a `finish_reason`
                ("stop", "length" or "abort") and `usage`; no frame follows it.
`ClientSessionInfo` the session after a `ClientSession` frame.
`ClientError`   a refusal. With a `request_id` it ends that request (nothing else will
                follow for it); with `request_id = None` it answers a frame that could not
                be decoded at all. `code` is one of the ERR_* values below.

With `--api-key`, every ClientSubmit, ClientAbort and ClientSession must carry a key in
`api_key` (ClientError "unauthorized" otherwise). A client that disconnects (its socket closes, or
stops answering ZeroMQ heartbeats) has its live requests aborted at once, streaming or not;
a new socket that takes over a departed client's routing id never receives that client's
output. A client
that does not read its frames until the engine's send queue to it is full has the
request being written to aborted (`ClientError`, code "slow_client" when deliverable).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from transport.messages.base import Message
from transport.messages.engine import ChatMessage, GenerationParams, TokenLogprob

MAX_CLIENT_FRAME_BYTES: Final = 4 * 1024 * 1024
MAX_REQUEST_ID_CHARS: Final = 256

# ClientError.code values.
ERR_MALFORMED: Final = "malformed_frame"  # not one decodable client frame
ERR_INVALID_REQUEST: Final = "invalid_request"  # refused by validation (bad params, prompt)
ERR_DUPLICATE_ID: Final = "duplicate_request_id"  # the id is live on this client already
ERR_SLOW_CLIENT: Final = "slow_client"  # the client stopped reading; request aborted
ERR_ENGINE: Final = "engine_error"  # the engine failed to take the request
ERR_UNAUTHORIZED: Final = "unauthorized"  # missing or wrong api_key
ERR_OVERLOADED: Final = "overloaded"  # the engine's queue is full: retry later
ERR_SHUTTING_DOWN: Final = "shutting_down"  # the engine is draining: no new requests
ERR_SESSION_NOT_FOUND: Final = "session_not_found"  # no such session (or it was closed)
ERR_SESSION_BUSY: Final = "session_busy"  # a turn of the session is running already
ERR_SESSION_LIMIT: Final = "session_limit"  # the most sessions are open already

FINISH_ABORT: Final = "abort"


class ClientSubmit(Message):
    request_id: str
    params: GenerationParams = GenerationParams()
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    stream: bool = True
    api_key: str | None = None  # required when the server runs with --api-key
    session_id: str = ""  # a turn of this streaming session


class ClientAbort(Message):
    request_id: str
    api_key: str | None = None


class ClientSession(Message):
    request_id: str
    op: Literal["open", "get", "close", "offload", "prefetch"]
    session_id: str = ""  # get, close, offload, prefetch
    ttl_s: float = 0.0  # open: idle timeout in seconds; 0: the server's default
    max_tokens: int = 0  # open: tokens the conversation may reach; 0: the context length
    priority: int = 0  # open: a higher one keeps its KV in the pool and the tiers longer
    retain_s: float = 0.0  # open: its KV stays in the tiers this long after each turn
    api_key: str | None = None


class ClientSessionInfo(Message):
    request_id: str
    session_id: str
    ttl_s: float
    max_tokens: int
    turns: int
    tokens: int  # conversation tokens as of the last good turn
    held_tokens: int  # tokens whose KV the session holds
    idle_s: float
    busy: bool
    closed: bool = False
    pool_tokens: int = 0  # of held_tokens, those in the pool (the rest wait in a tier)
    priority: int = 0
    retain_s: float = 0.0


class ClientUsage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class ClientChunk(Message):
    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    usage: ClientUsage | None = None  # on the last chunk of a request
    logprobs: list[TokenLogprob] = []


class ClientError(Message):
    code: str
    message: str
    request_id: str | None = None


ClientRequestFrame = ClientSubmit | ClientAbort | ClientSession
ClientReplyFrame = ClientChunk | ClientError | ClientSessionInfo
