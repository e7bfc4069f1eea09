"""Shared test plumbing: the session fixtures for real infrastructure live in tests/fixtures/."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from hpc.dist import order, rules

pytest_plugins = [
    "tests.fixtures.infra",
    "tests.fixtures.slurm",
    "tests.fixtures.mlflow",
    "tests.fixtures.toy",
    "tests.fixtures.vllm",
    "tests.fixtures.walkthrough",
]

# The CI machine has 2 cores shared with Slurm, MLflow and vLLM daemons (and the tests' own
# rank processes): a 2-thread OpenMP pool spin-waiting against them runs small matmuls up to
# 50x slower. One intra-op thread per process keeps timings sane and reproducible.
torch.set_num_threads(1)

# NCCL's rules are checked in every test and in every process a test starts (they inherit the
# environment): violations land in one log that each test's teardown reads.
# Each xdist worker keeps its own log: a violation in one worker's test must not fail the test
# the other worker is running.
os.environ[rules.ENV] = "1"
OWN_FILES: list[str] = []  # the temp files this process made for the session: removed at its end
if os.environ.get("PYTEST_XDIST_WORKER") or rules.LOG_ENV not in os.environ:
    os.environ[rules.LOG_ENV] = tempfile.mkstemp(prefix="dspark-nccl-rules-", suffix=".log")[1]
    OWN_FILES.append(os.environ[rules.LOG_ENV])
rules.install()


# A test that needs a real service or a model build is slow by definition: the fast suite
# (`-m "not slow"`, about 2 minutes on two workers) never starts Slurm, vLLM, an MLflow server or a toy build.
INFRA_FIXTURES = {"slurm_cluster", "cluster_network", "vllm_python", "toy_vllm", "vllm_server", "regen_server",
                  "mlflow_server",
                  "speculators_python", "toy_target", "toy_deepseek"}
# The session's one vLLM server, under each name its users know it by: they share one xdist group.
SHARED_SERVERS = ("toy_vllm", "vllm_server", "regen_server")
SHARED_GROUP = "toy-vllm"


# Under xdist (`-n 2 --dist loadgroup`, the README's test command) a worker takes one group at a
# time. A group is a file, so its module fixtures (a trained draft, a capture server) are built
# once; the host's single Slurm cluster and Ray runs share one group, whose worker owns them; the
# shared vLLM servers' users share a group per server, so each starts once. Slow groups go first and the unit
# files last: they fill the tail while the other worker finishes a long one.
# xdist 3.8's own loadgroup renames node ids, which pytest 9 no longer lets it do: the workers
# write each test's group to a file the controller's scheduler (below) reads instead.
HOST_WIDE = "host-wide"
GROUPS_ENV = "DSPARK_XDIST_GROUPS"


def pytest_configure(config):
    if config.getoption("numprocesses", default=None) and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[GROUPS_ENV] = tempfile.mkstemp(prefix="dspark-xdist-groups-", suffix=".json")[1]
        OWN_FILES.append(os.environ[GROUPS_ENV])


def pytest_unconfigure(config):
    for path in OWN_FILES:
        Path(path).unlink(missing_ok=True)
        shutil.rmtree(path + order.ORDER_SUFFIX, ignore_errors=True)


def _group(item, host_wide_files: set[str]) -> str:
    path = item.nodeid.split("::")[0]
    if path in host_wide_files:
        return HOST_WIDE
    return SHARED_GROUP if set(SHARED_SERVERS) & set(getattr(item, "fixturenames", ())) else path


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects: `-m "not slow"` sees these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if INFRA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    host_wide = {i.nodeid.split("::")[0] for i in items
                 if "slurm_cluster" in getattr(i, "fixturenames", ()) or i.get_closest_marker("host_wide")}
    groups = {id(i): _group(i, host_wide) for i in items}
    server_of = {i.nodeid.split("::")[0]: groups[id(i)] for i in items if groups[id(i)] == SHARED_GROUP}
    for i in items:  # a file with one user of a shared server goes whole with that server's group
        path = i.nodeid.split("::")[0]
        if path in server_of and groups[id(i)] != HOST_WIDE:
            groups[id(i)] = server_of[path]
    slow_in: dict[str, int] = {}
    for i in items:
        slow_in[groups[id(i)]] = slow_in.get(groups[id(i)], 0) + bool(i.get_closest_marker("slow"))
    first_seen = {g: n for n, g in reversed(list(enumerate(groups[id(i)] for i in items)))}
    path = os.environ.get(GROUPS_ENV)
    if path and "PYTEST_XDIST_WORKER" in os.environ:  # every worker collects the same: the last write wins
        items.sort(key=lambda i: (groups[id(i)] != HOST_WIDE, slow_in[groups[id(i)]] == 0,
                                  first_seen[groups[id(i)]]))
        tmp = f"{path}.{os.environ['PYTEST_XDIST_WORKER']}"
        Path(tmp).write_text(json.dumps({i.nodeid: groups[id(i)] for i in items}))
        os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` by our groups: xdist's scope scheduling, one group per work unit."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the workers have collected (scheduling starts then)
                self.groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text() or "{}")
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # xdist would hand out the groups with most tests first
    return ByGroup(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skip is a failure, whatever raised it (a skipif, an importorskip, a fixture): a
    green CI must mean every test ran."""
    from tests.fixtures.infra import in_ci

    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true ({reason}); CI must run every test"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (a module-level importorskip or skip)."""
    from tests.fixtures.infra import in_ci

    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci():
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at collection under CI=true; CI must run every test"


@pytest.fixture(autouse=True)
def _secrets_per_test():
    """The secrets a process's configs held mask its printouts (hpc.config.secrets.KNOWN): one
    process per command in use, one test at a time here."""
    from hpc.config import secrets

    secrets.KNOWN.clear()
    yield
    secrets.KNOWN.clear()


@pytest.fixture(autouse=True)
def nccl_rules_hold(request):
    """Fails the test when any of its processes broke an NCCL rule (see hpc/dist/rules.py)."""
    log = os.environ[rules.LOG_ENV]
    start = os.path.getsize(log) if os.path.exists(log) else 0
    orders = Path(log + order.ORDER_SUFFIX)  # each rank's data-plane ops, written at its shutdown
    shutil.rmtree(orders, ignore_errors=True)
    yield
    if request.node.get_closest_marker("nccl_violations_expected"):
        return
    with open(log) as fh:
        fh.seek(start)
        broken = fh.read()
    broken += "".join(f"NCCL rule broken: {p}\n" for p in order.compare(orders))
    if broken:
        pytest.fail(f"NCCL rules broken during this test:\n{broken}")
