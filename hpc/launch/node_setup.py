"""What node 0 of a job does once, while the job's other nodes wait for its answer.

Node 0 resolves the target to a local snapshot and prepares the training data; the others
read what it wrote on a filesystem every node sees (`cluster.log_dir`, `train.output_dir`).
If node 0 fails, it leaves an `.error` file beside the marker, so the others stop at once
with its reason instead of waiting out an hour.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

from hpc.config.schema import DSparkConfig
from hpc.config.target import is_local, localize, localized
from hpc.errors import UserError
from hpc.launch.job_files import owner_only, publish
from hpc.launch.slurm_env import SlurmEnv

# The nodes of one job start within seconds of each other; this covers clock skew between them
# and the shared filesystem, and a slow interpreter start.
START_SLACK_S = 600.0
PREPARE_TIMEOUT_S = 3600.0
POLL_S = 1.0


def localize_in_job(cfg: DSparkConfig, env: SlurmEnv) -> DSparkConfig:
    """The job's config naming the target's local snapshot: node 0 resolves a hub id, the others
    read the path it wrote under cluster.log_dir (a filesystem every node sees)."""
    if is_local(cfg.verifier.model):
        return cfg

    marker = Path(cfg.cluster.log_dir) / f".target-{env.job_id}"
    failed = marker.with_name(f"{marker.name}.error")
    # A job id comes back (a cluster whose state was reset counts from 1 again): a stale file must
    # not hand this job another model's path, an old snapshot's, or an old failure. So the files
    # name the target they answer for, and count only when written since this job's nodes started.
    ours = {"model": cfg.verifier.model, "revision": cfg.verifier.revision}
    since = time.time() - START_SLACK_S
    if env.node_index == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        # An earlier attempt's files go first: ours are then created exclusively (publish), so a
        # file someone planted in between is an error, never an answer.
        marker.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        try:
            cfg = localize(cfg)
        except UserError as err:  # the other nodes stop waiting and say why
            publish(failed, {**ours, "error": str(err)})
            raise
        publish(marker, {**ours, "path": cfg.verifier.model})
        print(f"target {cfg.verifier.name} -> {cfg.verifier.model}", flush=True)
        return cfg
    # A first download of a 600 GB target takes a while: wait as long as vLLM may take to start.
    timeout_s = cfg.verifier.health_timeout_s + 3600
    deadline = time.monotonic() + timeout_s
    while (found := _answer_for(marker, ours, since)) is None:
        if (error := _answer_for(failed, ours, since)) is not None:
            raise UserError(f"node 0 failed: {error['error']}")
        if time.monotonic() > deadline:
            raise UserError(f"node 0's snapshot of {cfg.verifier.model} did not appear within {timeout_s:.0f}s "
                            f"({marker}); check node 0's log")
        time.sleep(POLL_S)
    return replace(cfg, verifier=localized(cfg.verifier, Path(found["path"])))


def _answer_for(path: Path, ours: dict, since: float) -> dict | None:
    """`path`'s JSON when it answers for what `ours` names (a target, data settings) and was
    written after `since` by this job's user; None when absent, older, or another's.

    The directory may be group-writable (a team's log_dir) and an mtime is whatever its writer
    sets, so only an owner-only file of this user counts (what job_files.publish creates): a
    co-user's planted `.target-<jobid>` made node 1 load their directory with trust_remote_code."""
    try:
        st = path.lstat()
        if not owner_only(st) or st.st_mtime < since:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and all(data.get(k) == v for k, v in ours.items()) else None


def localize_stage(cfg: DSparkConfig) -> DSparkConfig:
    """The target as a local snapshot: once per job inside Slurm, in-process elsewhere."""
    if "SLURM_JOB_ID" in os.environ:
        return localize_in_job(cfg, SlurmEnv.from_environ())

    return localize(cfg)


def prepare_once(cfg: DSparkConfig, env: SlurmEnv) -> None:
    """Node 0 tokenises the data and prunes the vocab; the others wait for its marker (shared FS)."""
    from hpc.data.prepare import data_settings, prepare_data  # safetensors, torch: loaded only on this path

    marker = Path(cfg.train.output_dir) / "data" / f".prepared-{env.job_id}"
    failed = marker.with_name(f"{marker.name}.error")
    # The marker names the data settings it answers for. A requeued attempt takes its own earlier
    # attempt's marker; a first attempt takes only one written since its nodes started: an older
    # one is another job's whose id came back (a reset cluster counts from 1 again), and skipping
    # the preparation would train on that job's rows. Node 0 removes a marker it does not take,
    # so an attempt cut short while preparing leaves none for the requeue to trust. A failure
    # counts only from this attempt.
    ours = {"settings": json.loads(json.dumps(data_settings(cfg)))}
    this_attempt = {**ours, "attempt": env.restart_count}
    now = time.time()
    since = 0.0 if env.restart_count else now - START_SLACK_S
    if env.node_index == 0:
        if _answer_for(marker, ours, since) is not None:
            return
        marker.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        try:
            prep = prepare_data(cfg)
        except UserError as err:  # the other nodes stop waiting and say why
            publish(failed, {**this_attempt, "error": str(err)})
            raise
        print(f"data: {prep.stats.summary()}", flush=True)
        publish(marker, ours)
        return
    deadline = time.monotonic() + PREPARE_TIMEOUT_S
    while _answer_for(marker, ours, since) is None:
        if (error := _answer_for(failed, this_attempt, now - START_SLACK_S)) is not None:
            raise UserError(f"node 0 failed: {error['error']}")
        if time.monotonic() > deadline:
            raise UserError(f"the prepared data did not appear within {PREPARE_TIMEOUT_S:.0f}s ({marker}); "
                            "check node 0's log")
        time.sleep(POLL_S)
