"""YAML + CLI dotlist -> a typed DSparkConfig, with every problem collected, not just the first.

OmegaConf stops at the first bad key when merging a whole file, so we apply the file leaf by
leaf against the structured schema: each unknown key or type error becomes one line naming
the key, the value and the fix, and the user sees all of them in one run.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import math
import re
from dataclasses import is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, ValueNode
from omegaconf.errors import OmegaConfBaseException
from omegaconf.resolvers import oc as _oc

from hpc.config.schema import DSparkConfig
from hpc.config.secrets import env_resolved, scrub, shown
from hpc.config.shared_sweep import ABLATIONS, NO_HEAD, ablation_problems, share_problems, sweep_label
from hpc.config.target import follow_target, written_keys
from hpc.config.yaml_bounds import MAX_BYTES, load_bounded
from hpc.errors import ConfigError, UserError

_oc_env_default = _oc._DEFAULT_MARKER_  # "no default given", as oc.env tells it apart from None


def _env(key: str, default: Any = _oc_env_default) -> Any:
    """OmegaConf's own `oc.env`, recording a value that is a secret so it is masked wherever it lands."""
    return env_resolved(key, _oc.env(key, default))


OmegaConf.register_resolver("oc.env", _env, replace=True, annotation_validation="off")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` as a string; users (and OmegaConf) mean a float. A key given twice
    (a section pasted twice) is an error: plain YAML keeps the last copy without a word."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            # Every key of the schema is a name: `1:`, `true:`, `null:` or `[a, b]:` is a slip
            # (and an unhashable one would crash the check below).
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is not a name; keys are names "
                    "such as lr (quote it if it is meant as one)", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"`{key}` is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                    "keep one and merge the other into it", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
# YAML 1.1 reads `1:00:00` as the base-60 integer 3600, which Slurm then reads as 3600 minutes:
# `cluster.time: 1:00:00` asked for 60 hours. Colon-separated digits stay strings (times), ahead
# of the int and float resolvers.
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-9_]+)+(?:\.[0-9_]*)?$")
# And `0123` is the octal 83: `cluster.account: 0123` reached Slurm as account 83. Digits with
# a leading zero stay as written (an int key still reads them as decimal).
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")
for _first in "-+0123456789":
    _Loader.yaml_implicit_resolvers[_first].insert(0, ("tag:yaml.org,2002:str", _SEXAGESIMAL))
    _Loader.yaml_implicit_resolvers[_first].insert(0, ("tag:yaml.org,2002:str", _LEADING_ZERO))


def _schema_keys(node: DictConfig) -> list[str]:
    return [str(k) for k in node.keys()]


def _is_struct_section(node: Any) -> bool:
    """A section whose keys are fixed by a dataclass (as opposed to a free dict field)."""
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) not in (dict, None)


def _unknown_key(path: str, key: str, parent: DictConfig) -> str:
    close = difflib.get_close_matches(key, _schema_keys(parent), n=1)
    hint = f"did you mean `{(path + '.' if path else '')}{close[0]}`?" if close else (
        f"valid keys here: {', '.join(_schema_keys(parent))}"
    )
    full = f"{path}.{key}" if path else key
    return f"{full}: unknown key; {hint}"


# Keys that were dropped because nothing read them: an old YAML that sets one is told so and
# why, not that the key is unknown. List items are named without their index.
REMOVED = {
    "stream.port": "the rendezvous host picks a free port for each job",
    "eval.concurrency": "evaluation sends one request at a time to each server, as its tok/s assume",
    "data.sources.format": "each row is read by its `messages` or `conversations` column",
}


def _removed(full: str) -> str | None:
    why = REMOVED.get(re.sub(r"\[\d+\]", "", full))
    return f"{full}: removed, nothing read it ({why}); delete it" if why else None


def _drop_removed(full: str, value: Any, origin: str, problems: list[str]) -> Any:
    """A list of sections (data.sources) with the removed keys of its items reported and left out."""
    if not isinstance(value, list):
        return value
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            gone = {k for k in item if _removed(f"{full}.{k}")}
            problems.extend(f"{_removed(f'{full}[{i}].{k}')} ({origin})" for k in sorted(gone))
            item = {k: v for k, v in item.items() if k not in gone}
        out.append(item)
    return out


def _short(value: Any, key: str = "") -> str:
    text = scrub(repr(shown(key, value)))  # error lines land in job logs
    return text if len(text) <= 60 else text[:57] + "..."


# Kept hand-written (issue 13): OmegaConf's merge stops at the first bad key; leaf by leaf, one run lists every problem.
def _apply(cfg: DictConfig, data: dict, path: str, origin: str, problems: list[str], written: str = "") -> None:
    """`written`: the dotted key the user wrote the value at (an override's KEY); a YAML file
    writes every value where it stands."""
    for key, value in data.items():
        key = str(key)
        full = f"{path}.{key}" if path else key
        node = cfg if not path else OmegaConf.select(cfg, path)
        if key not in node:
            problems.append(f"{_removed(full) or _unknown_key(path, key, node)} ({origin})")
            continue
        child = node._get_node(key)
        value = _drop_removed(full, value, origin, problems)
        if _is_struct_section(child) and isinstance(value, dict):
            _apply(cfg, value, full, origin, problems, written)
            continue
        if isinstance(child, ListConfig) and isinstance(value, dict) and value and all(
                str(k).isdigit() for k in value):
            # `eval.compare.0.revision=SHA`: one key of one item (the dotlist made a dict of it),
            # not a new list. The item keeps its other keys.
            for idx, item in value.items():
                if int(idx) >= len(child):
                    problems.append(f"{full}.{idx}: {full} has {len(child)} item(s), so index {idx} is past its "
                                    f"end; write the whole list ({full}=[...]) to add one ({origin})")
                elif isinstance(item, dict) and _is_struct_section(child._get_node(int(idx))):
                    _apply(cfg, item, f"{full}.{idx}", origin, problems, written)
                else:
                    _set_leaf(cfg, f"{full}.{idx}", item, child._get_node(int(idx)), origin, problems)
            continue
        try:
            if isinstance(child, DictConfig) and isinstance(value, dict):
                # A free-form dict (compilation_config, env, sweep) is replaced where the user wrote
                # it: `compilation_config: {}` drops the default, and so does `...pass_config={}`
                # for that key; one key inside it (verifier.env.HF_TOKEN=x) keeps the others.
                inside = written[len(full) + 1:] if written.startswith(full + ".") else ""
                if inside and full == "sweep":  # its keys are dotted config keys, one level deep
                    OmegaConf.update(cfg, full, value, merge=True)
                elif inside:
                    for part in inside.split("."):
                        value = value[part]
                    OmegaConf.update(cfg, written, value, merge=False)
                else:
                    OmegaConf.update(cfg, full, value, merge=False)
            elif any(part.isdigit() for part in full.split(".")):  # inside a list's item: set in place
                OmegaConf.update(cfg, full, value, merge=True)
            else:
                # merge_with (not update) so lists of dicts become typed DataSource/... entries.
                cfg.merge_with(OmegaConf.create(_nest(full, value)))
        except OmegaConfBaseException as err:
            inner = _item_problems(full, value, child)
            inner = inner or [f"{full} = {_short(value, full)}: {_reason(err, child)}"]
            problems.extend(f"{line} ({origin})" for line in inner)


def _set_leaf(cfg: DictConfig, full: str, value: Any, child: Any, origin: str, problems: list[str]) -> None:
    try:
        OmegaConf.update(cfg, full, value, merge=True)
    except OmegaConfBaseException as err:
        problems.append(f"{full} = {_short(value, full)}: {_reason(err, child)} ({origin})")


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _reason(err: OmegaConfBaseException, node: Any) -> str:
    """What the key takes, in our words: OmegaConf's own text names its internals."""
    if isinstance(node, ValueNode):
        kind = node._metadata.ref_type
        if isinstance(kind, type) and issubclass(kind, Enum):
            return f"must be one of {', '.join(m.value for m in kind)}"
        if kind in _KINDS:
            return f"must be {_KINDS[kind]}" + ("" if node._metadata.optional is False else " or null")
    if isinstance(node, ListConfig):
        return "must be a list, e.g. [1, 2]"
    if isinstance(node, DictConfig):
        return "must be a mapping of keys to values"
    return str(err).splitlines()[0]


def _item_problems(full: str, value: Any, node: Any) -> list[str]:
    """The bad items of a list or free mapping that failed as a whole, each named by its own key
    (`data.sources[0].max_row`, `eval.num_speculative_tokens[1]`): "must be a list" about a list
    would send the user looking for the wrong mistake. [] when no single item is to blame."""
    if isinstance(node, ListConfig) and isinstance(value, list):
        items: list[tuple[str, Any]] = [(f"{full}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(node, DictConfig) and not _is_struct_section(node) and isinstance(value, dict):
        items = [(f"{full}.{k}", v) for k, v in value.items()]
    else:
        return []
    elem = node._metadata.element_type
    out = []
    for where, item in items:
        if isinstance(elem, type) and is_dataclass(elem):
            if not isinstance(item, dict):
                out.append(f"{where} = {_short(item, where)}: must be a mapping of {elem.__name__} keys")
                continue
            section = OmegaConf.structured(elem)
            OmegaConf.set_struct(section, True)
            for k, v in item.items():
                if str(k) not in section:
                    out.append(_unknown_key(where, str(k), section))
                    continue
                try:
                    section.merge_with({k: v})
                except OmegaConfBaseException as err:
                    out.append(f"{where}.{k} = {_short(v, f'{where}.{k}')}: {_reason(err, section._get_node(str(k)))}")
            continue
        try:
            ListConfig(content=[], element_type=elem).append(item)
        except OmegaConfBaseException as err:
            if getattr(elem, "__origin__", None) is list:
                reason = "must be a list, e.g. [1, 2]"
            elif isinstance(elem, type) and elem in _KINDS:
                reason = f"must be {_KINDS[elem]}"
            else:
                reason = str(err).splitlines()[0]
            out.append(f"{where} = {_short(item, where)}: {reason}")
    return out


def _schema() -> DictConfig:
    """The defaults, closed to unknown keys except inside free-form dict fields (sweep, env...)."""
    cfg = OmegaConf.structured(DSparkConfig)
    OmegaConf.set_struct(cfg, True)

    def open_free_dicts(node: DictConfig) -> None:
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                if _is_struct_section(child):
                    open_free_dicts(child)
                else:
                    OmegaConf.set_struct(child, False)

    open_free_dicts(cfg)
    return cfg


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file not found: {path}; pass a YAML file such as configs/toy-cpu.yaml")
    if path.stat().st_size > MAX_BYTES:  # not read at all: a 50 MB file took validate half a minute
        raise UserError(f"{path} is {path.stat().st_size:,} bytes, over the {MAX_BYTES:,} a config may have; "
                        "is it the right file?")
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        raise UserError(f"{path}: is a binary file, not a YAML config; pass a file such as configs/toy-cpu.yaml")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}); save the config as UTF-8") from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise UserError(f"{path}: is empty; start from configs/toy-cpu.yaml or configs/kimi-k2.6-dspark.yaml")
    try:
        data = load_bounded(text, _Loader, str(path)) or {}
    except ValueError as err:  # past a bound: before anything is built from it
        raise UserError(str(err)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}:{where} is not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (cluster, verifier, ...)")
    return data


def _parse_overrides(overrides: list[str], problems: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            problems.append(f"override `{item}`: expected KEY=VALUE, e.g. train.lr=1e-4")
            continue
        key, raw = item.split("=", 1)
        try:
            value = load_bounded(raw, _Loader, f"override `{key.strip()}`") if raw else ""
        except ValueError as err:
            problems.append(str(err))
            continue
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and " #" in raw and not raw.lstrip().startswith(("'", '"')):
            # YAML reads ` #` as a comment: `train.output_dir=runs/exp #2` would be cut to `runs/exp`,
            # and generated overrides carry user paths (two sweep variants then shared one directory).
            value = raw.strip()
        parsed.append((key.strip(), value))
    return parsed


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> DictConfig:
    """Schema defaults <- YAML file <- dotlist overrides. Raises ConfigError listing every problem."""
    cfg, problems = load_config_collecting(path, overrides)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config_collecting(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[DictConfig, list[str]]:
    """Like load_config, but returns the problems; bad leaves keep their schema defaults."""
    cfg = _schema()
    problems: list[str] = []
    written: set[str] = set()
    if path is not None:
        data = _read_yaml(Path(path))
        written = written_keys(data)
        _apply(cfg, data, "", str(path), problems)
    _apply_overrides(cfg, list(overrides or []), problems)
    written |= {key for key, _ in _parse_overrides(list(overrides or []), [])}
    follow_target(cfg, written)
    return cfg, problems


def with_overrides(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """A copy of a loaded config with a dotlist applied on top, and its problems: a sweep
    variant without reading the YAML again or rebuilding the schema, which cost far more than
    validating it. Interpolations still follow the variant's values."""
    out = copy.deepcopy(cfg)
    problems: list[str] = []
    _apply_overrides(out, overrides, problems)
    return out, problems


def _apply_overrides(cfg: DictConfig, overrides: list[str], problems: list[str]) -> None:
    for key, value in _parse_overrides(overrides, problems):
        # A sweep's keys are dotted config keys: `sweep.train.lr=[...]` adds the key `train.lr`.
        data = {"sweep": {key[len("sweep."):]: value}} if key.startswith("sweep.") else _nest(key, value)
        _apply(cfg, data, "", f"override {key}", problems, written=key)
    if not problems:
        try:
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as err:
            problems.append(f"{getattr(err, 'full_key', '?')}: {str(err).splitlines()[0]}")


def to_object(cfg: DictConfig) -> DSparkConfig:
    """The typed dataclass instance, interpolations resolved."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_hash(cfg: DictConfig) -> str:
    """Stable across key order and formatting: the identity of a resolved recipe."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values, for MLflow params and sweep expansion."""
    # A DictConfig's container is a dict with string keys.
    container = (cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
                 if not isinstance(cfg, dict) else cfg)
    out: dict[str, Any] = {}
    for key, value in container.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def sweep_overrides(cfg: DictConfig) -> list[list[str]]:
    """One dotlist per variant: the sweep's cartesian product, or the ablations (submit.ablations);
    [[]] when there is neither. Each names its column on the card (eval.label) unless the config does."""
    if OmegaConf.select(cfg, "submit.ablations", default=False) is True:
        return [[*extra, *(NO_HEAD if extra else ()), f"eval.label={name}"] for name, extra in ABLATIONS.items()]
    sweep = OmegaConf.to_container(cfg.sweep, resolve=True) or {}
    keys = sorted(sweep)
    base = OmegaConf.select(cfg, "eval.label", default=None)
    out = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        texts = [yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip() for v in combo]
        label = sweep_label(keys, texts)
        label = f"{base} {label}" if base else label
        out.append([*(f"{k}={t}" for k, t in zip(keys, texts)), f"eval.label={json.dumps(label)}"])
    return out if keys else [[]]


def check_sweep(cfg: DictConfig) -> list[str]:
    """Sweep keys must be config keys and every variant must itself be a valid config."""
    problems = []
    sweep = cast(dict[str, Any], OmegaConf.to_container(cfg.sweep, resolve=True) or {})  # schema: dict[str, list]
    count = math.prod(len(v) for v in sweep.values() if isinstance(v, list))
    cap = cfg.submit.max_variants
    if isinstance(cap, int) and cap < 1:
        problems.append(f"submit.max_variants = {cap}: must be at least 1 (the base config is one variant)")
    elif sweep and isinstance(cap, int) and count > cap:
        # Counted, not expanded: the product is what would be validated and queued one by one.
        sizes = " x ".join(str(len(v)) for v in sweep.values() if isinstance(v, list))
        problems.append(f"sweep: {sizes} = {count} variants, over submit.max_variants = {cap}; sweep fewer values, "
                        f"or raise submit.max_variants if {count} trainings are meant")
    probe = copy.deepcopy(cfg) if sweep else None  # one for every value: a fresh schema each costs more
    for key, values in sweep.items():
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__" or key.startswith("sweep"):
            problems.append(f"sweep.{key}: not a config key; sweep over keys like train.lr")
        elif key.split(".")[0] in ("cluster", "name"):
            # Every task of one Slurm array shares one allocation shape and one pipeline name.
            problems.append(f"sweep.{key}: the tasks of a training array share one allocation and name; "
                            f"submit one pipeline per value instead (dspark submit CONFIG {key}=VALUE)")
        elif not isinstance(values, list) or not values:
            problems.append(f"sweep.{key} = {_short(values)}: give a non-empty list of values")
        else:
            repeats = [v for i, v in enumerate(values) if v in values[:i]]
            if repeats:  # each value names one array task: a repeat trains the same variant twice
                problems.append(f"sweep.{key} = {_short(values)}: {repeats[0]!r} appears twice; list each value once")
            assert probe is not None  # made above whenever there is a sweep
            for value in values:
                sub: list[str] = []
                _apply(probe, _nest(key, value), "", f"sweep {key}", sub, written=key)
                problems.extend(sub)
    if OmegaConf.select(cfg, "submit.ablations", default=False) is True and not problems:
        problems += ablation_problems(cfg)  # three drafts of one DSpark config, from one capture
    elif OmegaConf.select(cfg, "submit.share_verifier", default=False) is True and not problems:
        problems += share_problems(sweep, count)  # every variant must be fed the others' samples
    return problems
