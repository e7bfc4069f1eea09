"""Ports on this host (stdlib only: the MLflow and vLLM launchers, the rendezvous and tests share it)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now. Another process can take it before our server binds it,
    so callers check what answers there (see VLLMServer.wait_healthy, MlflowServer.start)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
