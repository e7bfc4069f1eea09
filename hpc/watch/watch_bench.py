"""`dspark bench watch CONFIG`: what one `dspark watch` tick costs the login node.

A scheduled tick is a fresh process. It starts Python, reads the config, scrapes every endpoint,
asks the registry, logs a point and redraws a plot. Each round runs that tick as a subprocess,
then a peer subprocess that only GETs the same endpoints' /metrics with the same token. The
figure is their CPU time (user + sys, from the children's rusage) and the ratio of the medians.

`--local N` serves N endpoints on 127.0.0.1 in vLLM's format, about a real server's size
(hpc/watch/local_endpoints.py), and a throwaway MLflow tracking server whose champion was
evaluated at the served n. Without it, the bench reads the config's own serve.endpoints and registry. Then
its ticks are real ticks: they log points, and may fire.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc.tables import text_table
from hpc.track.keys import DRAFT_SHA256, MEAN_ACCEPT_LEN, SPEC_N, STAGE, STAGE_EVAL, TEMPERATURE
from hpc.track.registry import promote_if_better, register_draft
from hpc.track.server import MlflowServer
from hpc.verifier.verifier_checks import resolve
from hpc.watch.local_endpoints import MetricsServer

FAMILIES = 24  # histogram families per local endpoint: a /metrics body of about 500 lines, as vLLM's
GET = """
import os, sys, requests
s = requests.Session(); s.trust_env = False
tok = os.environ.get(sys.argv[1]) if sys.argv[1] else None
if tok: s.headers["Authorization"] = "Bearer " + tok
for u in sys.argv[2:]: s.get(u.rstrip("/") + "/metrics", timeout=10).raise_for_status()
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--local", type=int, default=0, metavar="N", help="N local endpoints and a throwaway registry")
    p.add_argument("--ticks", type=int, default=5, help="rounds: one tick and one bare GET each")


def _cpu_of(argv: list[str]) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, its output) of one child process run to completion."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"bench watch: {argv[3] if len(argv) > 3 else argv[0]} failed:\n{(res.stdout + res.stderr)[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, res.stdout


def _local_registry(uri: str, model: str, n: int) -> None:
    """A champion evaluated at n = its live tau, so the local ticks judge without firing."""
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    client = MlflowClient(uri)
    exp = client.create_experiment("bench-watch")
    run = client.create_run(exp, run_name=f"eval-n{n}", tags={STAGE: STAGE_EVAL, SPEC_N: str(n), TEMPERATURE: "0",
                                                              DRAFT_SHA256: "0" * 64})
    client.log_metric(run.info.run_id, MEAN_ACCEPT_LEN, 2.0)
    client.set_terminated(run.info.run_id)
    promote_if_better(client, model, register_draft(client, model, run.info.run_id, "draft", 2.0, {"b": "0"}, n=n))


def run(args: argparse.Namespace) -> int:
    overrides, servers = list(args.overrides), []
    with tempfile.TemporaryDirectory(prefix="dspark-bench-watch-") as tmp:
        tracking = None
        if args.local:
            servers = [MetricsServer(families=FAMILIES) for _ in range(args.local)]
            # A tracking server, as a cluster's ticks log to (a SQLite store would add its own start-up).
            tracking = MlflowServer(Path(tmp) / "mlflow").start()
            model = "bench-watch-draft"
            _local_registry(tracking.uri, model, 3)
            overrides += [f"serve.endpoints=[{', '.join(s.url for s in servers)}]", "serve.num_speculative_tokens=3",
                          f"serve.state_dir={tmp}/watch", f"tracking.uri={tracking.uri}",
                          "tracking.experiment=bench-watch", f"tracking.registered_model={model}"]
        cfg = resolve(args.config, overrides)
        tick = [sys.executable, "-m", "hpc", "watch", args.config, *overrides]
        get = [sys.executable, "-c", GET, cfg.serve.token_env or "", *cfg.serve.endpoints]
        rows, ticks, gets = [], [], []
        try:
            for i in range(args.ticks):
                for s in servers:  # traffic since the last tick: every tick has a delta to judge
                    s.traffic(200, 2.0)
                ticks.append(_cpu_of(tick))
                gets.append(_cpu_of(get))
                rows.append([str(i + 1), f"{ticks[-1][0]:.2f}", f"{ticks[-1][1]:.2f}", f"{gets[-1][0]:.2f}",
                             f"{gets[-1][1]:.2f}"])
        finally:
            for s in servers:
                s.close()
            if tracking is not None:
                tracking.stop()
    tick_cpu, get_cpu = statistics.median(t[0] for t in ticks), statistics.median(g[0] for g in gets)
    print("\n".join(text_table(["round", "tick CPU s", "tick wall s", "bare GET CPU s", "bare GET wall s"], rows,
                                right=range(5))))
    print(f"the last tick said: {ticks[-1][2].strip().splitlines()[-1] if ticks[-1][2].strip() else '(nothing)'}")
    where = f"{args.local} local endpoints" if args.local else f"{len(cfg.serve.endpoints)} endpoint(s) of the config"
    print(f"{where}: a tick costs {tick_cpu:.2f} s of CPU (median of {args.ticks}), a bare GET of the same "
          f"endpoints {get_cpu:.2f} s: {tick_cpu / get_cpu:.1f}x; the budget is 2 s for 8 endpoints")
    return 0
