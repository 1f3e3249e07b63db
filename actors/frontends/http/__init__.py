"""The HTTP gateway: an OpenAI-compatible server run by the `GatewayActor`.

Modules: `actor` (the actor and its uvicorn server), `app` (the ASGI app: routes, auth,
CORS, the endpoints), `asgi` (ASGI types, plain responses, request bodies under their size
and time limits, strict decoding), `streaming` (one generation request: its choices, the
JSON or SSE response, keep-alives, disconnects), `generation` (OpenAI requests to engine
jobs and engine chunks to OpenAI objects), `schemas` (the wire Structs), `sse`, `metrics`
(Prometheus text), `errors` (OpenAI error bodies).
"""

from __future__ import annotations
