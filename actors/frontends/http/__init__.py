"""The HTTP gateway: an OpenAI-compatible server run by the `GatewayActor`.

Modules: `actor` (the actor and its uvicorn server), `app` (the ASGI app: routes, auth,
body limits, streaming, disconnects), `generation` (OpenAI requests to engine jobs and
engine chunks to OpenAI objects), `schemas` (the wire Structs), `sse`, `metrics`
(Prometheus text), `errors` (OpenAI error bodies).
"""

from __future__ import annotations
