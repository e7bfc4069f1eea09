"""What runs inside each Slurm job of a pipeline.

The same functions back `dspark submit` (submitit pickles a call to them) and the plain
sbatch scripts (`dspark stage NAME CONFIG ...` under srun), so both paths behave alike:

- `train_allocation`: one task per node of a V + T node allocation. The node index decides
  the role: nodes [0, V) are verifier nodes (vLLM + one streamer, all the node's GPUs go to
  vLLM), nodes [V, V+T) run `train.ranks_per_node` trainer ranks each. The rendezvous host is
  the first trainer node: it picks a free port on its own address and publishes address and
  port in an owner-only file (hpc.launch.job_files), so concurrent allocations never collide
  and nobody can compute the port in advance. Gloo and NCCL bind the interface that holds the
  job's address (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless the user set them). A rank
  that dies takes its node's task down with it (non-zero exit), and `srun --kill-on-bad-exit`
  takes the allocation down: nothing hangs. Except when several drafts share the verifier: a
  trainer node whose draft failed records it (hpc.formats.draft_failure) and ends cleanly, the
  streamer drops that draft, and the others train on.
- Preemption: Slurm sends USR2 (`--signal=USR2@<cluster.signal_delay_s>`); every node forwards it to its ranks,
  which checkpoint at the next step boundary and exit with EXIT_REQUEUE; node 0 then asks
  Slurm to requeue the job, and the requeued job resumes from the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from hpc.config.schema import ClusterConfig, DSparkConfig, TrainConfig
from hpc.config.validate import ranks_per_node
from hpc.data.regen_ray import start_servers, stop_servers
from hpc.data.regenerate import (
    RegenStats,
    calibration_data,
    regenerate,
    regenerate_all,
    regenerated_dir,
    regeneration_complete,
    start_regen_server,
)
from hpc.errors import EXIT_REQUEUE, UserError
from hpc.evaluate.adaptive_card import adaptive_markdown, fetch_adaptive
from hpc.evaluate.compare import card_markdown, card_table, fetch_evals, pipeline_labels, to_csv
from hpc.evaluate.equal_budget import equal_budget_markdown, mlflow_per_prompt
from hpc.evaluate.runner import evaluate
from hpc.formats import draft_failure
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.launch.gpu_mode import check_shared_gpu
from hpc.launch.job_files import job_file, publish, wait_published
from hpc.launch.node_setup import prepare_once
from hpc.launch.preemption import last_window, requeue_timed
from hpc.launch.ray_cluster import RayNode, done_marker
from hpc.launch.slurm import run_slurm
from hpc.launch.slurm_env import SlurmEnv, advertised_ip, interface_of
from hpc.net import free_port
from hpc.own_env import set_own
from hpc.track.pipeline import STAGE, common_tags, create_child_run, end_pipeline_run, pipeline_outcome


def node_ranks(cfg: DSparkConfig, node_index: int, groups: int = 1) -> tuple[list[int], int, int]:
    """(global ranks on this node, trainer ranks T, verifier nodes V): trainers first, streamers after.
    With a shared verifier `groups` drafts each have trainer_nodes nodes, group after group."""
    V, Tn, rpn = cfg.cluster.verifier_nodes, cfg.cluster.trainer_nodes * groups, ranks_per_node(cfg)
    T = Tn * rpn
    if node_index < V:
        return [T + node_index], T, V
    t = node_index - V
    return list(range(t * rpn, (t + 1) * rpn)), T, V


def _rendezvous(cluster: ClusterConfig, env: SlurmEnv, master_node: int) -> tuple[str, int, str]:
    """(address, port, secret) of the torch rendezvous: chosen by the master node, read by the
    others from the owner-only job file (the secret authenticates the ranks: hpc.dist.rendezvous)."""
    from hpc.dist.rendezvous import new_secret  # torch: loaded only on this path

    path = job_file(cluster.log_dir, "rendezvous", env.job_id)
    mine = advertised_ip(env)
    iface = interface_of(mine)
    if iface and not mine.startswith("127."):
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            set_own(var, iface, default=True)
    if env.node_index == master_node:
        publish(path, {"addr": mine, "port": free_port(mine), "secret": new_secret()})
    info = wait_published(path, 600, f"node {master_node} (the rendezvous host)")
    assert info is not None  # None only when a `gone` marker is given
    return str(info["addr"]), int(info["port"]), str(info["secret"])


def train_allocation(cfg: DSparkConfig, parent_run_id: str | None = None,
                     variants: list[DSparkConfig] | None = None) -> int:
    """One node's share of a training allocation; returns the node's exit code. `variants`: the
    drafts a shared verifier's allocation trains, a group of trainer nodes each (`cfg` is the first)."""
    # torch: never on the login node, which imports this module to submit it
    from hpc.train.ranks import (
        exit_status,
        failed_drafts,
        failure_line,
        grace_s,
        record_draft_failure,
        spawn_ranks,
        supervise,
    )

    env = SlurmEnv.from_environ()
    K = len(variants) if variants else 1
    V, Tn = cfg.cluster.verifier_nodes, cfg.cluster.trainer_nodes * K
    if env.n_nodes != V + Tn:
        each = f" x {K} variants" if K > 1 else ""
        raise UserError(f"allocation has {env.n_nodes} nodes, the config needs cluster.verifier_nodes + "
                        f"cluster.trainer_nodes{each} = {V + Tn}")
    for draft in variants or [cfg]:
        prepare_once(draft, env)
    ranks, T, V = node_ranks(cfg, env.node_index, K)
    master_node = V if env.n_nodes > V else 0
    master, port, secret = _rendezvous(cfg.cluster, env, master_node)
    role = "verifier" if env.node_index < V else "trainer"
    of = f" of v{(env.node_index - V) // cfg.cluster.trainer_nodes}" if K > 1 and role == "trainer" else ""
    print(f"node {env.node_index} ({role}{of}): ranks {ranks}, rendezvous {master}:{port}", flush=True)
    # Node 0 requeued the last attempt: its window, from the record on disk (its own line went
    # with the step Slurm ended). Here, not in `stage all`: a `dspark submit` job has no batch step.
    if env.node_index == 0 and env.restart_count and (line := last_window(cfg, env.restart_count)):
        print(f"node 0 ({role}): attempt {env.restart_count + 1}; the last attempt's {line}", flush=True)
    # A trainer node's ranks take GPUs 0..n-1. A verifier node's one streamer takes the last GPU:
    # GPU 0 also holds vLLM's TP rank 0, where the capture connector stages its copies.
    locals_ = [max(cfg.cluster.gpus_per_node - 1, 0)] if role == "verifier" else list(range(len(ranks)))
    if role == "verifier" and cfg.train.dist_backend == "nccl":
        check_shared_gpu(locals_[0])
    procs = spawn_ranks(cfg, ranks, locals_, T, V, master, port, secret, parent_run_id, variants)
    stop = {"requested": False}

    def forward(signum, _frame):  # trainer ranks checkpoint at their next step boundary
        stop["requested"] = True
        if role == "trainer":  # streamers keep feeding until the trainers end the stream
            for p in procs:
                if p.pid and p.is_alive():
                    os.kill(p.pid, signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    # Several drafts: a trainer node's failure is its draft's alone (hpc.train.ranks.supervise).
    per = T // K
    drafts = [r // per if r < T else -1 for r in ranks] if K > 1 else None
    try:
        code, own = supervise(procs, grace_s(cfg), drafts)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if env.node_index == master_node:  # every node read it long ago; a reused job id must not find it
            job_file(cfg.cluster.log_dir, "rendezvous", env.job_id).unlink(missing_ok=True)
    if code == 0 and drafts and variants:
        # Named here, and in the draft's directory for its later stages and `dspark status`. The
        # task still ends cleanly: srun --kill-on-bad-exit would end the live drafts' nodes with it.
        for d in failed_drafts(own, drafts):
            line = record_draft_failure(variants[d], d, own, drafts, T, ranks)
            print(f"error: node {env.node_index} ({role}{of}): {line}", file=sys.stderr, flush=True)
    # a draft that failed on its own is not waited for: a requeue is for the live ones
    done = all(_training_done(draft.train) or draft_failure.read(draft.train.output_dir)
               for draft in variants or [cfg])
    if (code == EXIT_REQUEUE or (stop["requested"] and code == 0)) and not done:
        if env.node_index == 0:
            requeue_timed(cfg, lambda: requeue(env), EXIT_REQUEUE, variants)  # and the preemption window's record
        return EXIT_REQUEUE
    if code != 0:  # one line naming the cause, as `dspark train` ends: not "see the lines above"
        codes: list[int | None] = [None] * (T + V)
        for r, c in zip(ranks, own):
            codes[r] = c
        raise UserError(f"node {env.node_index} ({role}): {failure_line(codes, T, cfg.train.output_dir)}",
                        exit_code=exit_status(code))
    return code


def _training_done(train: TrainConfig) -> bool:
    """A signal that came after the last step needs no requeue: the checkpoints say so."""
    ckpt = latest_checkpoint(Path(train.output_dir) / "checkpoints")
    return ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= train.steps


def requeue(env: SlurmEnv) -> None:
    try:
        # scontrol's last line carries the reason; the job log keeps one line per event.
        run_slurm(["scontrol", "requeue", env.requeue_id], failed="requeue failed: {why}")
        msg = "requeued"
    except UserError as err:
        msg = str(err)
    print(f"job {env.requeue_id}: checkpointed; {msg}", flush=True)


def calibrate_stage(cfg: DSparkConfig, parent_run_id: str | None = None) -> int:
    """Fit the confidence calibration of the training task's export on its held-out rows."""
    from hpc.calibration.stage import calibrate_export  # safetensors, torch: loaded only on this path

    metrics = calibrate_export(cfg)
    if metrics and parent_run_id:
        _log_stage_run(cfg, parent_run_id, "calibrate", metrics)
    return 0


def eval_stage(cfg: DSparkConfig, n: int, parent_run_id: str | None = None) -> int:
    """Evaluate the export the training task left in train.output_dir, at one n."""
    draft = Path(cfg.train.output_dir) / "export"
    evaluate(cfg, str(draft), [n], parent_run_id=parent_run_id)
    return 0


def adaptive_stage(cfg: DSparkConfig, parent_run_id: str | None = None) -> int:
    """Adaptive verification for the training task's export, against fixed n at the same costs."""
    from hpc.evaluate.adaptive_job import evaluate_adaptive  # safetensors, torch: loaded only on this path

    if not cfg.eval.adaptive:  # an ablation without a confidence head, in a pipeline whose DSpark draft has one
        print(f"eval-adaptive: {cfg.eval.label or 'this variant'} sets eval.adaptive=false (no confidence head "
              "to rank drafted tokens by); nothing to evaluate", flush=True)
        return 0
    evaluate_adaptive(cfg, str(Path(cfg.train.output_dir) / "export"), parent_run_id)
    return 0


def report_stage(cfg: DSparkConfig, parent_run_id: str) -> int:
    """The comparison table of this pipeline, printed and written into its parent run; then the
    parent run ends FINISHED when every stage succeeded, else FAILED (never left RUNNING)."""
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    client = MlflowClient(cfg.tracking.uri)
    try:
        _report(cfg, client, parent_run_id)
    except BaseException as err:
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        end_pipeline_run(client, parent_run_id, "FAILED", f"the report failed: {why}")
        raise
    status, why = pipeline_outcome(client, parent_run_id, list(cfg.eval.num_speculative_tokens), cfg.eval.adaptive)
    end_pipeline_run(client, parent_run_id, status, why)
    print(f"pipeline run {parent_run_id}: {status} ({why})", flush=True)
    return 0


def _report(cfg: DSparkConfig, client, parent_run_id: str) -> None:
    parent = client.get_run(parent_run_id)
    evals = fetch_evals(client, [parent])
    if not evals:
        raise UserError(f"pipeline run {parent_run_id} has no eval runs to report (did the evals fail?)")
    table = card_table(evals)
    md = (card_markdown(table, evals) + equal_budget_markdown(evals, mlflow_per_prompt(client))
          + adaptive_markdown(fetch_adaptive(client, [parent], pipeline_labels([parent]))))
    print(md, flush=True)
    run_id = create_child_run(client, cfg.tracking.experiment, parent_run_id, "report",
                              {STAGE: "report", **common_tags(cfg)})
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in (("comparison.md", md), ("comparison.csv", to_csv(table))):
            (Path(tmp) / name).write_text(text + "\n")
            client.log_artifact(run_id, str(Path(tmp) / name))
            client.log_artifact(parent_run_id, str(Path(tmp) / name))
    client.set_terminated(run_id)


def regenerate_stage(cfg: DSparkConfig, parent_run_id: str | None = None, local: bool = False) -> int:
    """On-policy data: in a Slurm job over all its nodes (Ray, one vLLM server per node); with
    `local` (`dspark-dev demo`, even inside an salloc) one server on this machine. A requeue resumes."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    if not local:
        done = _regenerate_on_ray(cfg, say)
        if done is None:  # a worker node: node 0 reports
            return 0
        stats, cal_stats, servers, served = done
    else:
        server = start_regen_server(cfg.verifier, log_path=Path(cfg.data.output_dir) / "logs" / "regenerate-vllm-local.log")
        try:
            stats, cal_stats = regenerate_all(cfg.data, lambda data: regenerate(
                data, server.url, concurrency=cfg.data.regen_concurrency, log=say, api_key=server.api_key))
        finally:
            server.stop()
        servers, served = 1, []
    say(f"regenerate: {stats.summary()} -> {regenerated_dir(cfg.data)}")
    cal = calibration_data(cfg.data)
    if cal is not None and cal_stats is not None:
        say(f"regenerate: calibration rows: {cal_stats.summary()} -> {regenerated_dir(cal)}")
    if parent_run_id:
        metrics = {k: float(v) for k, v in vars(stats).items() if isinstance(v, (int, float))}
        if cal_stats is not None:
            metrics["calibration_written"] = float(cal_stats.written)
        metrics["servers"] = float(servers)
        metrics.update({f"served_{i}": float(n) for i, n in enumerate(served)})
        _log_stage_run(cfg, parent_run_id, "regenerate", metrics)
    return 0


def _regenerate_on_ray(cfg: DSparkConfig, say: Callable[[str], None]):
    """A Ray cluster over the job's nodes (see ray_cluster): node 0 drives `regenerate()` through one
    server per node and returns (stats, calibration rows' stats or None, servers, requests served per server);
    the other nodes host a server
    until node 0 is done, and return None."""
    env = SlurmEnv.from_environ()
    logs = Path(cfg.data.output_dir) / "logs"
    cal = calibration_data(cfg.data)
    if env.node_index == 0 and regeneration_complete(cfg.data) and (cal is None or regeneration_complete(cal)):
        say(f"regenerate: {regenerated_dir(cfg.data)} is complete; no servers started")
        logs.mkdir(parents=True, exist_ok=True)
        done_marker(logs, env).touch()
        return RegenStats(), None, 0, []
    node = RayNode(env, logs / f"ray-{env.job_id}-node{env.node_index}.log",
                   object_store_mb=cfg.cluster.ray_object_store_mb)
    try:
        if env.node_index != 0:
            if node.late:
                say(f"node {env.node_index}: node 0 had finished before this node started")
                return None
            say(f"node {env.node_index}: Ray worker for the regeneration servers, head {node.address}")
            say(f"node {env.node_index}: {node.serve()}")
            return None
        import ray  # only node 0 is a Ray driver

        try:
            node.connect(env.n_nodes, timeout_s=600)
            say(f"regenerate: Ray cluster of {env.n_nodes} node(s) at {node.address}")
            conc = cfg.data.regen_concurrency
            client = start_servers(cfg, env.n_nodes, logs, conc, log=say)
            try:
                stats, cal_stats = regenerate_all(cfg.data, lambda data: regenerate(
                    data, f"{len(client.actors)} Ray-hosted server(s)", concurrency=conc * len(client.actors),
                    client=client, log=say))
            finally:
                stop_servers(client)
            say(f"regenerate: requests served per node: {client.summary()}")
            return stats, cal_stats, len(client.actors), client.served
        finally:
            node.marker.touch()  # the workers end, whatever happened here
            ray.shutdown()
    finally:
        node.stop()


def _log_stage_run(cfg: DSparkConfig, parent_run_id: str, stage: str, metrics: dict[str, float]) -> None:
    """A child run for a stage that has no logger of its own; tracking trouble is not a failed stage."""
    try:
        from mlflow.entities import Metric  # mlflow: loaded only on this path
        from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

        client = MlflowClient(cfg.tracking.uri)
        run_id = create_child_run(client, cfg.tracking.experiment, parent_run_id, stage,
                                  {STAGE: stage, **common_tags(cfg)})
        client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        client.set_terminated(run_id)
    except Exception as err:  # noqa: BLE001
        from hpc.config.secrets import redact_uri, scrub  # optional: its absence is handled here

        print(f"warning: {stage} not logged to {redact_uri(cfg.tracking.uri)}: {scrub(str(err).splitlines()[0])[:160]}",
              flush=True)
