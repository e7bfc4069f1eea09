"""Reading the serving endpoints' /metrics: all at once, each within serve.timeout_s.

The token, when the endpoints want one, comes from the environment or an owner-only file and
travels only in the Authorization header: never in the config's values, argv, a URL or a log.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import requests

from hpc.errors import UserError
from hpc.evaluate.engines import parse_spec_metrics
from hpc.watch.drift import Reading

START_TIME = "process_start_time_seconds"


def read_token(token_env: str | None, token_file: str | None) -> str | None:
    """serve.token_env's variable or serve.token_file's first line; None when neither is set."""
    if token_env:
        value = os.environ.get(token_env, "").strip()
        if not value:
            raise UserError(f"serve.token_env = {token_env}: that variable is empty or not set here; export the "
                            "endpoints' token in it (a token never goes in the config or on a command line)")
        return value
    if token_file:
        path = Path(token_file).expanduser()
        try:
            st = os.stat(path)
            text = path.read_text()
        except OSError as err:
            raise UserError(f"serve.token_file = {token_file}: cannot read it ({err.strerror}); "
                            "write the token to a file only you can read (chmod 600)") from None
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise UserError(f"serve.token_file = {token_file}: mode {stat.filemode(st.st_mode)}, owner uid "
                            f"{st.st_uid}; it must be yours and readable by you alone: chmod 600 {token_file}")
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise UserError(f"serve.token_file = {token_file}: the file is empty; write the token on its first line")
        return token
    return None


def check_transport(endpoints: list[str], token: str | None, allow_http: bool) -> None:
    """A token sent over plain http can be read by anyone on the path: refuse unless told."""
    plain = [u for u in endpoints if urlsplit(u).scheme == "http"]
    if token and plain and not allow_http:
        raise UserError(f"serve.endpoints: {plain[0]} is plain http and a token is configured, which it would "
                        "carry in clear text; use https, or set serve.allow_http=true on a network you trust")


def metrics_url(base: str) -> str:
    return base.rstrip("/") + "/metrics"


def _read_one(session: requests.Session, url: str, timeout_s: float) -> Reading:
    try:
        resp = session.get(metrics_url(url), timeout=timeout_s)
    except requests.RequestException as err:
        return Reading(url, None, error=type(err).__name__)
    if resp.status_code != 200:
        why = "refused the token" if resp.status_code in (401, 403) else f"HTTP {resp.status_code}"
        return Reading(url, None, error=why)
    try:
        counters = parse_spec_metrics(resp.text)
    except ValueError as err:  # not Prometheus text: a proxy's error page, say
        return Reading(url, None, error=f"not Prometheus metrics ({str(err)[:60]})")
    started = next((float(line.split()[-1]) for line in resp.text.splitlines() if line.startswith(START_TIME + " ")),
                   None)
    return Reading(url, counters, started)


def scrape(endpoints: list[str], token: str | None, timeout_s: float) -> list[Reading]:
    """One Reading per endpoint, in order; an endpoint that fails says why in its Reading."""
    session = requests.Session()
    session.trust_env = False  # a login node's proxy variables must not reroute (or log) the token
    if token:
        session.headers["Authorization"] = f"Bearer {token}"
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(endpoints)))) as pool:
        return list(pool.map(lambda u: _read_one(session, u, timeout_s), endpoints))
