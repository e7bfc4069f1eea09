"""Login-node checks of the serving watch (`serve:`) and what triggers a scheduled retrain.

The champion's evaluation at the served n needs the registry: `dspark validate` checks it from
the launcher (hpc/launch/watch_cli.py), which may talk to MLflow; these checks read the config only.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig, Trigger
from hpc.config.secrets import looks_secret
from hpc.formats.slurm_time import TIME_FIX, parse_slurm_time

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _endpoint_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as err:
        return f"not a URL ({err}); write it as http://HOST:PORT"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL of a vLLM server; write it as http://HOST:PORT"
    if parts.username is not None or parts.password is not None:
        return ("carries credentials, which would reach logs and MLflow; put the token in a variable named by "
                "serve.token_env or a chmod-600 file named by serve.token_file")
    if parts.query or parts.fragment:
        return "has a query or fragment; give the server's base URL (its /metrics is read)"
    return None


def check_serve(c: Checker, cfg: DSparkConfig) -> None:
    s = cfg.serve
    if not str(s.state_dir).strip():
        c.fail("serve.state_dir", s.state_dir, "empty; name the directory a watch tick keeps its counters in")
    for i, url in enumerate(s.endpoints):
        why = _endpoint_problem(str(url))
        if why:
            c.fail(f"serve.endpoints[{i}]", url, why)
    if len(set(s.endpoints)) != len(s.endpoints):
        c.fail("serve.endpoints", s.endpoints, "lists an endpoint twice: its traffic would count twice")
    if not 0 < s.drift_ratio <= 1:
        c.fail("serve.drift_ratio", s.drift_ratio, "must be in (0, 1]: drift fires below this share of the "
               "evaluated acceptance length, e.g. 0.9")
    if s.window < 1:
        c.fail("serve.window", s.window, "must be >= 1: the ticks in a row below the line before drift fires")
    c.nonneg("serve.min_drafts", s.min_drafts)
    c.positive("serve.timeout_s", s.timeout_s, "seconds to wait for each endpoint's /metrics")
    if s.num_speculative_tokens is not None:
        c.positive("serve.num_speculative_tokens", s.num_speculative_tokens, "the n the endpoints serve")
    try:
        parse_slurm_time(s.cooldown)
    except ValueError:
        c.fail("serve.cooldown", s.cooldown, f"not a duration; {TIME_FIX} (e.g. 1-00:00:00 for a day)")
    if s.token_env and s.token_file:
        c.fail("serve.token_env", s.token_env, "serve.token_file is set too; keep one")
    if s.token_env and (not ENV_NAME.fullmatch(s.token_env) or looks_secret(s.token_env)):
        c.fail("serve.token_env", s.token_env, "must name an environment variable (e.g. DSPARK_SERVE_TOKEN), "
               "not hold the token; export the token in that variable")
    plain = [u for u in s.endpoints if str(u).startswith("http://")]
    if (s.token_env or s.token_file) and plain and not s.allow_http:
        c.fail("serve.endpoints", plain[0], "plain http, and a token is configured that it would carry in clear "
               "text; use https, or set serve.allow_http=true on a network you trust")
    if cfg.schedule.trigger in (Trigger.drift, Trigger.both) and not s.endpoints:
        c.fail("schedule.trigger", cfg.schedule.trigger.value, "drift needs the servers to watch: list them "
               "under serve.endpoints (a serve: section), or use trigger: cron")
