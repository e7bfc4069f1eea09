"""Secrets in a config (an HF token under `verifier.env`, a password in `tracking.uri`) are
needed by the jobs, but never logged: MLflow params, config files handed to MLflow, and lines
printed into shared job logs see them masked."""

from __future__ import annotations

import copy
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from hpc.config.schema import DSparkConfig

MASK = "***"
# Generous on purpose: a name masked for nothing costs a log line's value, a secret missed leaks it.
SECRET_NAME = re.compile(r"token|secret|pass|pwd|key$|key_|api_?key|credential|auth|cookie|(^|_)pat$",
                         re.IGNORECASE)
# A URI anywhere in a text: exception messages (MLflow's, urllib's) quote the request URL.
_URI = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_uri(uri: str) -> str:
    """`https://user:pw@host/?token=x` -> `https://user:***@host/?token=***`."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}" if ":" in creds else f"{MASK}@{host}"
    query = parts.query
    if query:
        query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in parse_qsl(query, keep_blank_values=True)],
                          safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return uri  # unchanged: urlunsplit would drop the empty authority of sqlite:///path
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def without_credentials(uri: str) -> str:
    """`https://user:pw@host/x` -> `https://host/x`: a link for a browser, which asks for the login."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if "@" not in parts.netloc:
        return uri
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[1], parts.path, parts.query, parts.fragment))


def scrub(text: str) -> str:
    """`text` with every URI in it redacted as `redact_uri` does: for exception messages in logs."""
    return _URI.sub(lambda m: redact_uri(m.group(0)), text)


# vLLM's flags that take a secret ("token" alone would also match --max-num-batched-tokens).
SECRET_FLAGS = ("--hf-token", "--api-key", "--ssl-keyfile-password")


def redact_args(args: list[str]) -> list[str]:
    """vLLM's command-line flags with the values of secret ones masked (`--hf-token X`, `--api-key=X`)."""
    out, hide_next = [], False
    for arg in args:
        flag, eq, _ = arg.partition("=")
        if hide_next and not arg.startswith("-"):
            out.append(MASK)
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}={MASK}")
        else:
            out.append(arg)
        hide_next = not eq and arg in SECRET_FLAGS
    return out


def redacted(cfg: DSparkConfig) -> DSparkConfig:
    """A copy of a DSparkConfig fit for logging; the original keeps its secrets for the jobs."""
    out = copy.deepcopy(cfg)
    out.verifier.env = {k: (MASK if is_secret_name(k) else v) for k, v in out.verifier.env.items()}
    out.verifier.extra_args = redact_args(list(out.verifier.extra_args))
    out.tracking.uri = redact_uri(out.tracking.uri)
    return out
