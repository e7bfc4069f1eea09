"""Our key middleware for vLLM: every route but /health needs the server's key."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from hpc.verifier.vllm_auth import KeyOnEveryRoute


def _call(path: str, headers: dict[str, str] | None = None, kind: str = "http") -> tuple[list, bool]:
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    sent: list = []

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "path": path, "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(KeyOnEveryRoute(app, key="s3cret")(scope, None, send))
    return sent, bool(reached)


@pytest.mark.parametrize("path", ["/invocations", "/metrics", "/tokenize", "/pooling", "/v1/completions", "/",
                                  "/health/../invocations", "/HEALTH"])
def test_every_route_but_health_needs_the_key(path):
    sent, reached = _call(path)
    assert not reached and sent[0]["status"] == 401
    assert _call(path, {"Authorization": "Bearer wrong"})[1] is False
    assert _call(path, {"Authorization": "Basic s3cret"})[1] is False
    assert _call(path, {"Authorization": "Bearer s3cret"})[1] is True


def test_health_stays_open_and_websockets_are_closed_without_the_key():
    assert _call("/health")[1] is True  # readiness: says only that the server is up
    sent, reached = _call("/v1/realtime", kind="websocket")
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]
    assert _call("/health", kind="websocket")[1] is False
    assert _call("/v1/realtime", {"Authorization": "Bearer s3cret"}, kind="websocket")[1] is True


def test_a_server_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        KeyOnEveryRoute(lambda *a: None)


def test_the_server_command_carries_the_middleware_on_its_path(tmp_path):
    from hpc.verifier.vllm_server import start_vllm_server

    server = start_vllm_server("/bin/true", "m", port=1, wait=False, log_path=tmp_path / "s.log", base_args=[],
                               env={"PYTHONPATH": "/keep/me"})
    server.proc.wait()
    args = list(map(str, server.proc.args))
    assert args[args.index("--middleware") + 1] == "dspark_vllm_auth.KeyOnEveryRoute"
    assert server.plugin_dir is not None and (server.plugin_dir / "dspark_vllm_auth.py").is_file()
    copy = server.plugin_dir / "dspark_vllm_auth.py"
    # vLLM's venv has no hpc: the copy imports with the standard library alone (-S: no site-packages).
    code = (f"import importlib.util as u; s = u.spec_from_file_location('m', {str(copy)!r}); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.KeyOnEveryRoute.__name__)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "KeyOnEveryRoute", out.stderr
    server.stop()
    assert not server.plugin_dir.exists()
