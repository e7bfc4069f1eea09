"""The API key on every route of our vLLM servers, not only vLLM's guarded prefixes.

vLLM's own key middleware checks only paths under /v1, /v2, /inference and /cohere. The rest
answer anyone on the node: /invocations serves completions (so a co-user's request makes the
capture server write a ~1 GB capture into our private directory), /metrics is what the
evaluation reads acceptance from (their requests would skew it, and the registry's champion),
and /tokenize and /pooling run the model too. This ASGI middleware, given to vLLM with
`--middleware`, refuses every HTTP and WebSocket request that lacks the server's key, except
/health, which says only that the server is up (our readiness check reads it).

Imported inside vLLM's own venv from a copy of this file on its PYTHONPATH: stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

MODULE = "dspark_vllm_auth"  # the copy's name on vLLM's PYTHONPATH
OPEN_PATHS = frozenset({"/health"})


class KeyOnEveryRoute:
    """Pure ASGI: `Authorization: Bearer <VLLM_API_KEY>` or 401 (a WebSocket is closed, 1008)."""

    def __init__(self, app, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get("VLLM_API_KEY", "")
        if not key:  # a server we start always has one: never serve open by accident
            raise RuntimeError("KeyOnEveryRoute needs VLLM_API_KEY in the server's environment")
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS and scope["type"] == "http":
            return True
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": "Unauthorized"}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
