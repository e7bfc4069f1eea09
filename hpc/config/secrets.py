"""Secrets in a config (an HF token under `verifier.env`, a password in `tracking.uri`) are
needed by the jobs, but never logged: MLflow params, config files handed to MLflow, and lines
printed into shared job logs see them masked."""

from __future__ import annotations

import copy
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from hpc.config.schema import DSparkConfig

MASK = "***"
SECRET_NAME = re.compile(r"token|secret|passw|api_?key|access_?key|credential|auth|cookie", re.IGNORECASE)


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


def redacted(cfg: DSparkConfig) -> DSparkConfig:
    """A copy of a DSparkConfig fit for logging; the original keeps its secrets for the jobs."""
    out = copy.deepcopy(cfg)
    out.verifier.env = {k: (MASK if is_secret_name(k) else v) for k, v in out.verifier.env.items()}
    out.tracking.uri = redact_uri(out.tracking.uri)
    return out
