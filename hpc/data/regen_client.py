"""Chat completions against an OpenAI-compatible server (vLLM), with retries.

A failed request is retried with exponential backoff when the cause may pass (connection
errors, timeouts, 5xx, 429): urllib3's Retry on the session, which also honours Retry-After.
A 4xx is the row's own fault (e.g. a prompt longer than max_model_len) and is not retried.
Either way the caller gets RequestFailed and skips that row only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import requests
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

from hpc.errors import UserError

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    """One request gave up; ``reason`` is the skip counter it goes to."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Reply:
    content: str
    truncated: bool  # stopped by max_tokens rather than by the model


class Completer(Protocol):
    """What regeneration asks of a client: ChatClient, or RayChatClient over several servers."""

    model: str
    max_tokens: int
    temperature: float

    def complete(self, messages: list[dict], seed: int | None = None) -> Reply: ...


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(url: str, timeout: float = 30.0, api_key: str | None = None) -> str:
    """The id the server serves under; with --server-url it need not equal verifier.model."""
    try:
        resp = requests.get(f"{url.rstrip('/')}/v1/models", timeout=timeout, headers=auth_headers(api_key))
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (requests.RequestException, KeyError, IndexError, ValueError) as err:
        raise UserError(f"no OpenAI-compatible server answers at {url} ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); check --server-url or the server log") from None


@dataclass
class ChatClient:
    url: str
    model: str
    max_tokens: int
    temperature: float = 0.0
    timeout: float = 600.0  # one long generation on a busy server may take minutes
    retries: int = 3
    backoff: float = 1.0  # urllib3's backoff_factor: the first retry at once, then 2x, 4x ... this many seconds
    api_key: str | None = field(default=None, repr=False)  # the server's key, sent with every request
    # requests.Session is not documented as thread-safe: one per worker thread.
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            session = requests.Session()
            session.headers.update(auth_headers(self.api_key))
            # allowed_methods=None: POST is retried too, even after the server may have read it, as
            # a chat completion changes nothing on the server: asking again only costs its compute.
            # raise_on_status=False: the last retryable reply comes back, so its body names the cause.
            retry = Retry(total=self.retries, backoff_factor=self.backoff, status_forcelist=RETRYABLE_STATUS,
                          allowed_methods=None, respect_retry_after_header=True, raise_on_status=False)
            session.mount("http://", HTTPAdapter(max_retries=retry))
            session.mount("https://", HTTPAdapter(max_retries=retry))
            self._local.session = session
        return self._local.session

    def complete(self, messages: list[dict], seed: int | None = None) -> Reply:
        payload: dict = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                         "temperature": self.temperature}
        if seed is not None:
            payload["seed"] = seed
        attempts = f"{self.retries + 1} attempts, last"
        try:
            resp = self._session().post(f"{self.url.rstrip('/')}/v1/chat/completions",
                                        json=payload, timeout=self.timeout)
        except requests.RequestException as err:
            raise RequestFailed("request_failed", f"{attempts}: {type(err).__name__}: {err}") from None
        if resp.status_code in RETRYABLE_STATUS:
            raise RequestFailed("request_failed", f"{attempts}: HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code >= 400:
            raise RequestFailed("rejected", f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            choice = resp.json()["choices"][0]
            content = choice["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            # A 200 the server could not form is its bug, not load: asking again would not mend it.
            raise RequestFailed("request_failed", f"malformed response ({err!r}): {resp.text[:200]}") from None
        return Reply(content, choice.get("finish_reason") == "length")
