"""On-policy training data: regenerate the assistant turns of data.sources with the target.

System and user turns are kept, the original assistant turns dropped, and each assistant turn
is asked of the target through its OpenAI-compatible server (/v1/chat/completions), with the
REGENERATED history fed back for later turns, so the draft learns what the target really says.

    stats = regenerate(cfg.data, server.url, shard_size=1000, concurrency=8, progress=True)

Rows go out in input order whatever the concurrency (see ordered_map), as `messages` rows with
the input row's global index and its original id/source; shards and resume: regen_shards.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TypeVar

from hpc.config.schema import DataConfig, VerifierConfig
from hpc.data.reader import read_source
from hpc.data.regen_client import ChatClient, Completer, RequestFailed, served_model
from hpc.data.regen_progress import Reporter, count_rows
from hpc.data.regen_shards import MANIFEST, ShardStore
from hpc.data.sources import to_messages
from hpc.errors import UserError
from hpc.verifier.vllm_server import VLLMServer, config_flags, server_env, start_vllm_server

T = TypeVar("T")
R = TypeVar("R")


def regenerated_dir(data: DataConfig) -> Path:
    return Path(data.output_dir) / "regenerated"


def calibration_data(data: DataConfig) -> DataConfig | None:
    """data.calibration_sources as a data config of their own, regenerated into (and read from)
    {data.output_dir}/calibration, so they never mix with the training rows. None when unset."""
    if not data.calibration_sources:
        return None
    return dataclasses.replace(data, sources=list(data.calibration_sources), calibration_sources=[],
                               output_dir=str(Path(data.output_dir) / "calibration"))


def regenerate_all(data: DataConfig, run: Callable[[DataConfig], RegenStats]) -> tuple[RegenStats, RegenStats | None]:
    """`run` (a regenerate() call) over the training sources, then over the calibration sources
    (None when there are none), each into its own directory."""
    cal = calibration_data(data)
    return run(data), (None if cal is None else run(cal))


def serve_args(v: VerifierConfig) -> list[str]:
    """vLLM flags for plain generation from a VerifierConfig; `extra_args` come last, so they win.

    Unlike the capture server there is no hidden-state capture, and prefix caching stays on:
    turn j + 1 of a conversation re-sends turn j's prompt and reply.
    """
    return config_flags(v) + list(v.extra_args)


def start_regen_server(v: VerifierConfig, log_path: str | Path | None = None) -> VLLMServer:
    """The target behind /v1/chat/completions; on 127.0.0.1, as only we call it."""
    return start_vllm_server(v.python, v.model, host="127.0.0.1", port=v.port or None, base_args=serve_args(v),
                             env=server_env(v), log_path=log_path, timeout=v.health_timeout_s,
                             entrypoint=v.entrypoint)


@dataclass
class RegenStats:
    written: int = 0  # rows written by this run
    skipped: Counter = field(default_factory=Counter)  # by reason, this run
    shards: int = 0  # shards written by this run
    resumed_rows: int = 0  # input rows already in complete shards when the run began
    resumed_shards: int = 0
    truncated_turns: int = 0  # replies cut by max_tokens (kept: still the target's own text)
    seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return (self.written + sum(self.skipped.values())) / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        why = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        resumed = f"; resumed after {self.resumed_rows} rows in {self.resumed_shards} shards" if self.resumed_shards else ""
        return (f"{self.written} rows written, {sum(self.skipped.values())} skipped ({why}), "
                f"{self.shards} shards{resumed}; {self.truncated_turns} replies hit max_tokens; "
                f"{self.rows_per_s:.2f} rows/s")


def plan_turns(messages: list[dict]) -> list[list[dict]]:
    """Split a conversation into the segments each regenerated reply answers.

    A reply goes where the original had an assistant turn (a run of them gives one reply) and
    after a final user turn; a segment must hold a user turn, so an assistant turn before any
    user turn is dropped. System/user turns after the last reply are dropped (nothing to learn).
    """
    segments: list[list[dict]] = []
    pending: list[dict] = []
    for m in messages:
        if m["role"] != "assistant":
            pending.append({"role": m["role"], "content": m["content"]})
        elif any(p["role"] == "user" for p in pending):
            segments.append(pending)
            pending = []
    if any(p["role"] == "user" for p in pending):
        segments.append(pending)
    return segments


@dataclass
class Outcome:
    index: int
    record: dict | None = None
    reason: str | None = None  # skip counter when record is None
    truncated: int = 0


def regenerate_row(client: Completer, index: int, row: dict, seed: int | None) -> Outcome:
    try:
        segments = plan_turns(to_messages(row))
    except (ValueError, KeyError, TypeError):
        return Outcome(index, reason="malformed")
    if not segments:
        return Outcome(index, reason="no_user_turn")
    history: list[dict] = []
    truncated = 0
    for turn, segment in enumerate(segments):
        history.extend(segment)
        try:
            # A per-request seed makes sampled (temperature > 0) data reproducible, batching aside.
            reply = client.complete(history, None if seed is None else (seed + index * 1009 + turn) % 2**31)
        except RequestFailed as err:
            return Outcome(index, reason=err.reason)
        history.append({"role": "assistant", "content": reply.content})
        truncated += reply.truncated
    record = {"row": index, "id": row.get("id"), "source": row.get("source"), "messages": history}
    return Outcome(index, record, truncated=truncated)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """fn over items on a thread pool, yielded in input order, at most ~2 x workers in flight.

    Unlike Executor.map this does not read the whole input first (1.4M rows), and the order of
    results (hence shard contents) does not depend on which request finished first.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="regen")
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * max(1, workers):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # Early exit (error, Ctrl-C, consumer stopped): drop queued work, leave running requests.
        pool.shutdown(wait=False, cancel_futures=True)


def source_rows(data: DataConfig, max_rows: int | None = None) -> Iterator[tuple[int, dict]]:
    """(global index, row) over data.sources in config order: the order shards follow."""
    rows = (row for src in data.sources for row in read_source(src))
    return enumerate(islice(rows, max_rows))


def _source_settings(data: DataConfig) -> list[list]:
    return [s.settings() for s in data.sources]


def regeneration_complete(data: DataConfig) -> bool:
    """The shards cover every row of these very sources (a requeue after the last shard)."""
    try:
        m = json.loads((regenerated_dir(data) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return bool(m.get("finished")) and m.get("settings", {}).get("sources") == _source_settings(data)


def regenerate(data: DataConfig, server_url: str, *, shard_size: int = 1000, concurrency: int = 4,
               progress: bool = False, max_rows: int | None = None, max_consecutive_failures: int = 32,
               client: Completer | None = None, log: Callable[[str], None] = print,
               api_key: str | None = None) -> RegenStats:
    """Regenerate every row of data.sources into {data.output_dir}/regenerated; resumes.

    ``max_rows`` stops after that many input rows (a later run without it continues). After
    ``max_consecutive_failures`` failed rows in a row the server is taken for dead: UserError,
    without writing the shard in progress, so a re-run redoes those rows instead of losing them.
    So a shard is not written while a run of failures is open (it grows until a row succeeds):
    written, the first rows of a dying server's run would be skipped for good. (A run shorter
    than that at the data's end is taken for failed rows, as it would be anywhere else.)
    """
    t0 = time.monotonic()
    if client is None:
        client = ChatClient(server_url, served_model(server_url, api_key=api_key), data.regen_max_tokens,
                            data.regen_temperature, api_key=api_key)
    store = ShardStore(regenerated_dir(data), shard_size, {
        "sources": _source_settings(data), "model": client.model,
        "temperature": client.temperature, "max_tokens": client.max_tokens, "seed": data.seed})
    start = store.open()
    stats = RegenStats(resumed_rows=start, resumed_shards=len(store.shards))
    if store.finished:
        log(f"regenerate: {store.root} is complete ({start} input rows); nothing to do")
        return stats
    seed = data.seed if client.temperature > 0 else None
    total = count_rows(data.sources)
    if max_rows is not None:
        total = max_rows if total is None else min(total, max_rows)
    records: list[dict] = []
    skipped: Counter = Counter()
    shard_start = end = start
    failures = 0
    with Reporter(progress, total, start, log) as report:
        work = islice(source_rows(data, max_rows), start, None)
        for out in ordered_map(lambda item: regenerate_row(client, item[0], item[1], seed), work, concurrency):
            end = out.index + 1
            if out.record is not None:
                records.append(out.record)
                stats.truncated_turns += out.truncated
                failures = 0
            else:
                skipped[out.reason] += 1
                failures = failures + 1 if out.reason == "request_failed" else 0
                if failures >= max_consecutive_failures:
                    raise UserError(f"{failures} rows in a row failed against {server_url} (is the server "
                                    f"down?); {len(store.shards)} shards are complete, re-run to resume")
            report.advance(written=out.record is not None)
            if end - shard_start >= shard_size and not failures:
                _flush(store, shard_start, end, records, skipped, stats, report)
                records, skipped, shard_start = [], Counter(), end
        if end > shard_start:  # a short last shard: the data ended or max_rows cut it
            _flush(store, shard_start, end, records, skipped, stats, report)
        if max_rows is None or end < max_rows:  # the data itself ended
            store.finish()
    stats.seconds = time.monotonic() - t0
    return stats


def _flush(store: ShardStore, start: int, end: int, records: list[dict], skipped: Counter,
           stats: RegenStats, report: Reporter) -> None:
    info = store.write(start, end, records, skipped)
    stats.written += info.written
    stats.skipped.update(skipped)
    stats.shards += 1
    report.log(f"{info.name}: rows {start}..{end - 1}, {info.written} written, {sum(skipped.values())} skipped")
