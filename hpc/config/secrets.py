"""Secrets in a config (an HF token under `verifier.env`, a password in `tracking.uri`) are
needed by the jobs, but never logged: MLflow params, config files handed to MLflow, and lines
printed into shared job logs see them masked."""

from __future__ import annotations

import base64
import copy
import dataclasses
import os
import re
import traceback
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from hpc.config.schema import DSparkConfig

MASK = "***"
# Values that are secrets wherever interpolation carries them (`tracking.experiment=${verifier.env.X}`,
# `${oc.env:HF_TOKEN}` in any key): every value of this process's configs that equals one is masked
# when printed or logged. Filled by `remember_secrets` (each resolved config) and `env_resolved`.
KNOWN: set[str] = set()
EMBEDDED_MIN = 6  # a secret this long is masked inside longer values too; a shorter one only whole
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|PWD|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH", re.IGNORECASE)
# A value that is a secret whatever its name: a connection string's key=value pairs (Azure's
# ...;AccountKey=...), a token with a vendor prefix, or a long random-looking word.
SECRET_VALUE = re.compile(
    r"(^|[;&?,\s])(account_?key|shared_?access_?key|password|pwd|secret|token|sig|signature|api_?key)=[^;&\s]"
    r"|\b(hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{16,}|github_pat_\w{16,}|sk-[\w-]{16,}|xox[abprs]-[\w-]{10,}"
    r"|AKIA[0-9A-Z]{16}|eyJ[\w-]{10,}\.[\w-]{10,})"
    r"|^(?=[^/\s]*[0-9])(?=[^/\s]*[A-Za-z])[A-Za-z0-9+/_=-]{32,}$",
    re.IGNORECASE)
# A URI anywhere in a text: exception messages (MLflow's, urllib's) quote the request URL.
_URI = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)
_CREDS = re.compile(r"//([^/@:]*)(:[^/]*)?@")  # the authority's user[:password]@, up to its last @


def tracking_auth_header(env=None) -> str | None:
    """The Authorization header MLflow's clients send from its standard variables:
    MLFLOW_TRACKING_TOKEN (bearer), else MLFLOW_TRACKING_USERNAME / _PASSWORD (basic)."""
    env = os.environ if env is None else env
    if env.get("MLFLOW_TRACKING_TOKEN"):
        return f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
    if env.get("MLFLOW_TRACKING_USERNAME") or env.get("MLFLOW_TRACKING_PASSWORD"):
        pair = f"{env.get('MLFLOW_TRACKING_USERNAME', '')}:{env.get('MLFLOW_TRACKING_PASSWORD', '')}"
        return "Basic " + base64.b64encode(pair.encode()).decode()
    return None


def looks_secret(value: str) -> bool:
    """A value to mask whatever key holds it (masking by name alone logged an Azure connection
    string's AccountKey and a `--hf-tok` abbreviation's token)."""
    return bool(SECRET_VALUE.search(str(value)))


def redact_uri(uri: str) -> str:
    """`https://user:pw@host/?token=x&ws=a` -> `https://user:***@host/?token=***&ws=***`: a
    query's values are masked whatever their names (`?access=`, `?sig=`, a vendor's own)."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # malformed (a bad IPv6 host): its credentials are masked all the same
        return _CREDS.sub(lambda m: f"//{m.group(1)}:{MASK}@" if m.group(2) is not None else f"//{MASK}@", uri)
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}" if ":" in creds else f"{MASK}@{host}"
    query = parts.query
    if query:
        query = urlencode([(k, MASK) for k, _ in parse_qsl(query, keep_blank_values=True)], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return uri  # unchanged: urlunsplit would drop the empty authority of sqlite:///path
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def env_resolved(name: str, value):
    """`${oc.env:NAME}` resolved to `value`: a secret when its name or its value looks like one."""
    if isinstance(value, str) and value and (SECRET_NAME.search(name) or looks_secret(value)):
        KNOWN.add(value)
    return value


def _secret_values(cfg: DSparkConfig) -> set[str]:
    """The secrets a resolved config holds: verifier.env's values, secret flags' values, the URI's password."""
    found = {str(v) for v in cfg.verifier.env.values() if v is not None and str(v)}
    args = [str(a) for a in cfg.verifier.extra_args]
    for i, arg in enumerate(args):
        if names_flag(arg, SECRET_FLAGS) is not None:
            found.add(arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else ""))
    try:
        found.add(unquote(urlsplit(cfg.tracking.uri).password or ""))
    except ValueError:
        pass
    return found - {""}


def remember_secrets(cfg: DSparkConfig) -> None:
    KNOWN.update(_secret_values(cfg))


def _masked(value, secrets: set[str]):
    """`value` with every secret in it masked: a value equal to one whole, a long one inside it too."""
    if not isinstance(value, str) or not secrets:
        return value
    if value in secrets:
        return MASK
    for secret in secrets:
        if len(secret) >= EMBEDDED_MIN and secret in value:
            value = value.replace(secret, MASK)
    return value


def _mask_tree(node, secrets: set[str]):
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            setattr(node, f.name, _mask_tree(getattr(node, f.name), secrets))
        return node
    if isinstance(node, list):
        return [_mask_tree(v, secrets) for v in node]
    if isinstance(node, dict):
        return {k: _mask_tree(v, secrets) for k, v in node.items()}
    return _masked(node, secrets)


def shown(key: str, value):
    """`value` as an error line about `key` may show it: env values masked, URIs redacted.
    Every value under `verifier.env` is masked: it is where secrets go (tokens, connection
    strings, a proxy's password), under names nobody can list in advance."""
    if key.startswith("verifier.env"):
        return MASK
    # An extra_args word that is not a bare flag may be a secret flag's value (`--hf-token X`).
    if key.startswith("verifier.extra_args") and not (isinstance(value, str) and value.startswith("-")
                                                       and "=" not in value):
        return MASK
    if isinstance(value, str):
        if looks_secret(value):  # a token typed where a name belongs
            return MASK
        return scrub(_masked(value, KNOWN))  # a secret interpolated into this key
    return value


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
# Real vLLM flags that are prefixes of the flags above or of those we own: argparse takes an exact
# match over an abbreviation, so these name themselves.
EXACT_FLAGS = frozenset({"--ssl-keyfile"})


def names_flag(arg: str, flags) -> str | None:
    """The flag of `flags` that the word `arg` names: exactly, in either spelling, or as any
    prefix of it, which vLLM's argument parser takes as that flag (`--hos` for `--host`, where
    unambiguous; an ambiguous one fails there, so refusing it costs nothing)."""
    flag = flag_name(arg)
    if not flag.startswith("--") or len(flag) < 3:
        return None
    if flag in flags:
        return flag
    if flag in EXACT_FLAGS:
        return None
    return next((f for f in flags if f.startswith(flag)), None)


def scrubbed_traceback() -> str:
    """The exception being handled, as a traceback with every URI's credentials masked: error
    texts (MLflow's, urllib's) quote request URLs, and tracebacks land in shared job logs."""
    return scrub(traceback.format_exc())


def flag_name(arg: str) -> str:
    """`--hf_token=X` -> `--hf-token`: vLLM's parser takes either spelling of a flag."""
    flag = arg.partition("=")[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def redact_args(args: list[str]) -> list[str]:
    """Command-line words with the values of secret flags masked (`--hf-token X`, `--api_key=X`)
    and any credentials in a URI among them."""
    out, hide_next = [], False
    for arg in map(str, args):
        secret = names_flag(arg, SECRET_FLAGS) is not None
        if (hide_next and not arg.startswith("-")) or looks_secret(arg.partition("=")[2] or arg):
            out.append(MASK if "=" not in arg or not arg.startswith("-") else f"{arg.partition('=')[0]}={MASK}")
        elif secret and "=" in arg:
            out.append(f"{arg.partition('=')[0]}={MASK}")
        else:
            out.append(scrub(arg))
        hide_next = secret and "=" not in arg
    return out


def redacted(cfg: DSparkConfig) -> DSparkConfig:
    """A copy of a DSparkConfig fit for logging; the original keeps its secrets for the jobs."""
    out = copy.deepcopy(cfg)
    remember_secrets(cfg)
    out.verifier.env = {k: MASK for k in out.verifier.env}  # its names stay: they say what was set
    out.verifier.extra_args = redact_args(list(out.verifier.extra_args))
    out.tracking.uri = redact_uri(out.tracking.uri)
    # and wherever interpolation carried a secret: `tracking.experiment=${verifier.env.HF_TOKEN}`
    return _mask_tree(out, set(KNOWN))
