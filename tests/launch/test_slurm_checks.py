"""Login-node checks of a pipeline's Slurm requests (hpc/launch/slurm.py).

The first half asks the real dev cluster (`slurm_cluster`); the error paths fake
`subprocess.run`, so they need no Slurm at all.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpc.config.schema import DSparkConfig
from hpc.errors import UserError
from hpc.launch import slurm
from hpc.launch.slurm import (
    SINFO_MISSING,
    JobRequest,
    Partition,
    account_exists,
    cancel,
    check_requests,
    parse_slurm_time,
    partitions,
    requests_for,
)
from tests.fixtures.recipes import resolve_recipe
from tests.fixtures.slurm import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]
# Hub-id style names are not looked up on a login node, so the toy config resolves without
# the built toy target or its data (and, through resolve_recipe, without asking a vLLM).
NO_FILES = ["verifier.model=toy/qwen3", "data.sources=[{path: toy/data}]"]
# The validator wants the batch to split over every trainer rank; 120 does for 1, 3 and 10 nodes
# (and each trainer's stream buffer to hold its micro-batch).
SPLITS = ("train.global_batch_size=120", "stream.buffer_per_trainer=30")


def _toy(partition: str, *overrides: str) -> DSparkConfig:
    return resolve_recipe(ROOT / "configs" / "toy-cpu.yaml", [*NO_FILES, f"cluster.partition={partition}", *overrides])


def _with_key(problems: list[str], key: str) -> list[str]:
    return [p for p in problems if p.startswith(key) or f" {key} " in p or f"{key} =" in p]


# ---- against the real dev cluster ---------------------------------------------------------


@pytest.mark.timeout(60, func_only=True)
def test_toy_config_fits_the_dev_cluster(slurm_cluster: SlurmCluster) -> None:
    parts = partitions()
    part = parts[slurm_cluster.partition]
    assert part == Partition(slurm_cluster.partition, len(slurm_cluster.node_names), None, True, True)

    reqs = requests_for(_toy(slurm_cluster.partition))
    assert [(r.stage, r.nodes) for r in reqs] == [
        ("regenerate", 1), ("train", 2), ("eval", 1), ("report", 1)]
    assert all(r.partition == slurm_cluster.partition and r.time == "01:00:00" for r in reqs)
    assert check_requests(reqs) == []


@pytest.mark.timeout(60, func_only=True)
def test_unknown_partition_lists_the_real_ones(slurm_cluster: SlurmCluster) -> None:
    problems = check_requests(requests_for(_toy("gpux")))
    # Every stage uses the same partition: one line, not four.
    assert problems == [
        f"cluster.partition = 'gpux': no such partition; sinfo lists: {slurm_cluster.partition}"]


@pytest.mark.timeout(60, func_only=True)
def test_too_many_nodes_names_the_key(slurm_cluster: SlurmCluster) -> None:
    n = len(slurm_cluster.node_names)
    cfg = _toy(slurm_cluster.partition, "cluster.trainer_nodes=10", *SPLITS)
    problems = check_requests(requests_for(cfg))
    assert len(problems) == 1, problems
    assert "cluster.trainer_nodes" in problems[0] and "cluster.verifier_nodes" in problems[0]
    assert f"= 11: the train job needs 11 nodes but partition '{slurm_cluster.partition}' has {n}" \
        in problems[0]


@pytest.mark.timeout(60, func_only=True)
def test_missing_account(slurm_cluster: SlurmCluster) -> None:
    # slurmdbd creates the root account when the cluster registers.
    assert account_exists("root") is True
    assert account_exists("no-such-acct") is False
    problems = check_requests(
        requests_for(_toy(slurm_cluster.partition, "cluster.account=no-such-acct")))
    assert len(problems) == 1, problems
    assert problems[0].startswith("cluster.account = 'no-such-acct': no such Slurm account")


@pytest.mark.timeout(60, func_only=True)
def test_several_problems_come_back_together(slurm_cluster: SlurmCluster) -> None:
    cfg = _toy(slurm_cluster.partition, "cluster.trainer_nodes=10",
               "cluster.regenerate_nodes=4", "cluster.account=no-such-acct", *SPLITS)
    cfg.cluster.time = "1:2:3:4"  # past the config validator, as a hand-built config could be
    cfg.cluster.eval_nodes = 5  # (the validator wants 1)
    problems = check_requests(requests_for(cfg))
    for key in ("cluster.regenerate_nodes", "cluster.trainer_nodes", "cluster.eval_nodes",
                "cluster.account", "cluster.time"):
        assert len(_with_key(problems, key)) == 1, (key, problems)
    assert len(problems) == 5, problems
    assert all("\n" not in p for p in problems)


@pytest.mark.timeout(60, func_only=True)
def test_cancel_removes_queued_jobs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ids = [
        subprocess.run(
            ["sbatch", "--parsable", "--hold", "-p", slurm_cluster.partition, "-t", "1",
             "-o", str(tmp_path / "%j.out"), "--wrap", "sleep 60"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().split(";")[0]
        for _ in range(2)
    ]
    cancel(ids)
    states = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%T"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert states == ["CANCELLED", "CANCELLED"], states
    cancel(ids)  # jobs that already ended are not an error
    cancel([])


# ---- error paths, with subprocess.run faked ----------------------------------------------


Answer = tuple[int, str, str] | BaseException


def _fake_slurm(monkeypatch: pytest.MonkeyPatch, **answers: Answer) -> list[list[str]]:
    """subprocess.run answering per program name (sinfo=..., sacctmgr=..., scancel=...)."""
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        answer = answers.get(argv[0], FileNotFoundError(argv[0]))
        if isinstance(answer, BaseException):
            raise answer
        rc, out, err = answer
        return subprocess.CompletedProcess(argv, rc, out, err)

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    return calls


REQ = JobRequest("train", "gpu", 2, "01:00:00", None, 8, 16)
SINFO = (0, "gpu*|4|2-00:00:00|up\nshort|8|30:00|up\nmaint|4|infinite|down\n", "")


def test_sinfo_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch)
    assert check_requests([REQ]) == [SINFO_MISSING]
    assert SINFO_MISSING.startswith("sinfo not found: run dspark submit on a Slurm login node")
    with pytest.raises(UserError, match="sinfo not found"):
        partitions()


def test_sinfo_failing_or_silent_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch, sinfo=(1, "", "sinfo: error: Unable to contact slurm controller\n"))
    assert check_requests([REQ]) == [
        "sinfo failed (exit 1): sinfo: error: Unable to contact slurm controller; "
        "check SLURM_CONF and `scontrol ping`"]
    _fake_slurm(monkeypatch, sinfo=subprocess.TimeoutExpired("sinfo", 30))
    assert check_requests([REQ])[0].startswith("sinfo did not answer within 30 s")


@pytest.mark.parametrize("output", [
    "this is not sinfo output\n", "gpu|four|infinite|up\n", "gpu|4|sometimes|up\n", "gpu|4|up\n"])
def test_unparsable_sinfo_output_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    _fake_slurm(monkeypatch, sinfo=(0, output, ""))
    problems = check_requests([REQ])
    assert len(problems) == 1
    assert problems[0].startswith(f"sinfo output not understood: {output.strip()!r}")
    assert "NAME|NODES|TIMELIMIT|AVAIL" in problems[0]


def test_sinfo_partitions_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A partition split over two lines (nodes in different configs) is summed.
    calls = _fake_slurm(monkeypatch, sinfo=(0, SINFO[1] + "short|2|30:00|up\n", ""))
    assert partitions() == {
        "gpu": Partition("gpu", 4, 2 * 24 * 60, True, True),
        "short": Partition("short", 10, 30, True, False),
        "maint": Partition("maint", 4, None, False, False),
    }
    assert calls == [["sinfo", "-h", "-a", "-o", "%P|%D|%l|%a"]]


def test_time_over_max_down_partition_and_nodes_together(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch, sinfo=SINFO)
    reqs = [replace(REQ, partition="short", nodes=9),
            replace(REQ, stage="eval", partition="maint", nodes=1, time="3-00:00:00")]
    problems = check_requests(reqs)
    assert len(problems) == 3, problems
    over = _with_key(problems, "cluster.time")
    assert over == ["cluster.time = '01:00:00': over partition 'short''s MaxTime 00:30:00; "
                    "set cluster.time <= 00:30:00"]
    assert len(_with_key(problems, "cluster.trainer_nodes")) == 1
    down = [p for p in problems if "not up" in p]
    assert len(down) == 1 and down[0].startswith("cluster.partition = 'maint'")
    # 'maint' has no MaxTime: three days is fine there.
    assert not any("3-00:00:00" in p for p in problems)


def test_zero_time_means_unlimited_and_partition_with_max_refuses_it(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_slurm(monkeypatch, sinfo=SINFO, sacctmgr=(0, "", ""))
    assert check_requests([replace(REQ, time="0")])[0].startswith("cluster.time = '0': over")
    assert check_requests([replace(REQ, partition="maint", time="0", account=None)]) == [
        "cluster.partition = 'maint': partition is not up (sinfo says it is down, drained or "
        "inactive); choose another or ask the admins"]


def test_unlimited_is_refused_by_a_partition_with_max_as_zero_is(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch, sinfo=SINFO, sacctmgr=(0, "", ""))
    for text in ("UNLIMITED", "infinite"):
        assert check_requests([replace(REQ, time=text)]) == [
            f"cluster.time = {text!r}: over partition 'gpu''s MaxTime 2-00:00:00; set cluster.time <= 2-00:00:00"]
    assert check_requests([replace(REQ, partition="maint", time="UNLIMITED", account=None)]) == [
        "cluster.partition = 'maint': partition is not up (sinfo says it is down, drained or "
        "inactive); choose another or ask the admins"]


@pytest.mark.parametrize("text", ["UNLIMITED", "infinite", ""])
def test_the_validator_the_slurm_check_and_submit_read_a_time_alike(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    from hpc.config.validate import validate
    from hpc.launch.submit import _minutes

    cfg = _toy("open", *SPLITS)
    cfg.cluster.time = text
    by_validator = any(p.startswith("cluster.time") for p in validate(cfg, check_tracking=False, check_vllm=False))
    _fake_slurm(monkeypatch, sinfo=(0, "open|4|infinite|up\n", ""), sacctmgr=(0, "", ""))
    problems = check_requests([replace(REQ, partition="open", time=text)])
    by_slurm_check = any("not a Slurm time" in p for p in problems)
    try:
        _minutes(text)  # submitit's timeout_min
        by_submit = False
    except ValueError:
        by_submit = True
    refused = text == ""  # no limit is a Slurm time; nothing at all is not
    assert by_validator == by_slurm_check == by_submit == refused, (by_validator, by_slurm_check, by_submit)
    assert problems == ([f"cluster.time = '': not a Slurm time; {slurm.TIME_FIX}"] if refused else [])


def test_report_job_too_big_names_the_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch, sinfo=(0, "empty|0|infinite|up\n", ""))
    problems = check_requests([JobRequest("report", "empty", 1, "10", None, 0, 1)])
    assert len(problems) == 1 and problems[0].startswith("cluster.partition = 'empty'")


def test_sacctmgr_failing_skips_the_account_check(monkeypatch: pytest.MonkeyPatch) -> None:
    no_dbd = (1, "", "sacctmgr: error: You are not running a supported accounting_storage plugin")
    calls = _fake_slurm(monkeypatch, sinfo=SINFO, sacctmgr=no_dbd)
    assert account_exists("proj") is None
    assert check_requests([replace(REQ, account="proj")]) == []
    assert ["sacctmgr", "-nP", "show", "account", "proj", "format=account"] in calls

    _fake_slurm(monkeypatch, sinfo=SINFO)  # no sacctmgr at all
    assert account_exists("proj") is None
    assert check_requests([replace(REQ, account="proj")]) == []

    _fake_slurm(monkeypatch, sinfo=SINFO, sacctmgr=(0, "proj\n", ""))
    assert account_exists("PROJ") is True
    _fake_slurm(monkeypatch, sinfo=SINFO, sacctmgr=(0, "", ""))
    assert check_requests([replace(REQ, account="proj")]) == [
        "cluster.account = 'proj': no such Slurm account; set it to one "
        "`sacctmgr show associations user=$USER format=account` lists"]


def test_no_account_is_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_slurm(monkeypatch, sinfo=SINFO)
    assert check_requests([REQ]) == []
    assert [c[0] for c in calls] == ["sinfo"]


def test_cancel_error_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_slurm(monkeypatch)
    cancel([])
    assert calls == []
    with pytest.raises(UserError, match=r"scancel not found; cancel them by hand: scancel 7 8_1"):
        cancel(["7", "8_1"])

    done = "scancel: error: Kill job error on job id 7: Job/step already completing or completed"
    calls = _fake_slurm(monkeypatch, scancel=(1, "", done + "\n"))
    cancel(["7", "8"])
    assert calls == [["scancel", "7", "8"]]  # one call for all of them

    _fake_slurm(monkeypatch, scancel=(1, "", "scancel: error: Unable to contact slurm controller\n"))
    with pytest.raises(UserError, match="scancel failed: .*Unable to contact.*scancel 7 8$"):
        cancel(["7", "8"])


# ---- pure parsing -------------------------------------------------------------------------


@pytest.mark.parametrize("text, minutes", [
    ("UNLIMITED", None), ("infinite", None), ("INFINITE", None),
    ("0", 0), ("30", 30), ("90", 90),
    ("30:00", 30), ("30:01", 31), ("0:59", 1),
    ("01:00:00", 60), ("48:00:00", 2880), ("1:30:30", 91),
    ("2-0", 2880), ("1-12", 2160), ("1-12:30", 2190), ("1-00:00:01", 1441), (" 2-00:00:00 ", 2880),
])
def test_parse_slurm_time(text: str, minutes: int | None) -> None:
    assert parse_slurm_time(text) == minutes


@pytest.mark.parametrize(
    "text", ["", "abc", "1:2:3:4", "1-2:3:4:5", "-1", "1-", "1:", "1.5", "1-2-3", "1h"])
def test_parse_slurm_time_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        parse_slurm_time(text)


def test_requests_without_regeneration() -> None:
    cfg = _toy("debug", "data.regenerate=false", "cluster.verifier_nodes=2",
               "cluster.trainer_nodes=3", "cluster.account=proj", *SPLITS)
    reqs = requests_for(cfg)
    assert [(r.stage, r.nodes, r.gpus_per_node) for r in reqs] == [
        ("train", 5, 2), ("eval", 1, 2), ("report", 1, 0)]
    assert {(r.partition, r.time, r.account, r.cpus_per_task) for r in reqs} == {
        ("debug", "01:00:00", "proj", 1)}


def test_a_sweep_past_max_array_size_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.launch.slurm import array_problems

    config = (0, "Configuration data as of 2026-12-03T22:00:00\nMaxArraySize            = 8\nMaxJobCount = 10000\n", "")
    calls = _fake_slurm(monkeypatch, scontrol=config)
    assert array_problems(8) == []  # task ids 0..7
    assert array_problems(9) == ["sweep: 9 variants, but this cluster's MaxArraySize is 8 (task ids 0..7); sweep at "
                                 "most 8 combinations, or submit the sweep as several pipelines"]
    assert calls[0] == ["scontrol", "show", "config"]
    assert array_problems(1) == [] and len(calls) == 2  # one task is no array: not asked
    _fake_slurm(monkeypatch)  # no scontrol: sinfo's own check says Slurm is missing
    assert array_problems(9) == []
    _fake_slurm(monkeypatch, scontrol=(1, "", "slurm_load_ctl_conf error"))
    assert array_problems(9) == []


def test_the_dev_clusters_max_array_size_is_read(slurm_cluster: SlurmCluster) -> None:
    from hpc.launch.slurm import max_array_size

    assert isinstance(max_array_size(), int)


def test_a_shared_verifier_that_does_not_fit_names_the_most_variants_that_do(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slurm(monkeypatch, sinfo=SINFO)  # partition gpu: 4 nodes
    # 1 verifier node + 5 variants x 1 trainer node = 6 nodes: 3 variants would fit.
    (line,) = check_requests([replace(REQ, nodes=6, groups=5, per_group=1)])
    assert line.startswith("cluster.verifier_nodes + 5 variants x cluster.trainer_nodes = 6: ")
    assert "at most 3 variants fit" in line and "submit.share_verifier=false" in line
    assert check_requests([replace(REQ, nodes=4, groups=3, per_group=1)]) == []
