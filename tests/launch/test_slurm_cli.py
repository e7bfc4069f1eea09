"""The Slurm CLI wrappers without Slurm: subprocess.run is faked, as submitit tests its own.

Covers the wrappers the slow real-cluster tests reach only on their happy path: `scontrol show
hostnames` and `scontrol requeue` inside a job, and `squeue` / `sbatch` / `scrontab -l` behind
`dspark schedule`; and `run_slurm`, through which every one of them runs. (sinfo, sacctmgr and
scancel: test_slurm_checks.py; sacct: test_status.py.)
"""

from __future__ import annotations

import datetime
import subprocess
from collections.abc import Callable

import pytest

from hpc.errors import UserError
from hpc.launch import schedule_slurm as ss
from hpc.launch import stages
from hpc.launch.slurm import SlurmMissing, run_slurm
from hpc.launch.slurm_env import SlurmEnv

Reply = Callable[[list[str]], subprocess.CompletedProcess]


def done(argv: list[str], rc: int = 0, out: str = "", err: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.fixture
def slurm(monkeypatch):
    """Install `reply` as subprocess.run; returns the argv of every call."""
    calls: list[list[str]] = []

    def install(reply: Reply) -> list[list[str]]:
        def run(argv, check: bool = False, **_):
            calls.append(list(argv))
            res = reply(list(argv))
            if check and res.returncode:  # what the real run does with check=True
                raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
            return res
        monkeypatch.setattr(subprocess, "run", run)
        return calls
    return install


def missing(argv: list[str]) -> subprocess.CompletedProcess:
    raise FileNotFoundError(2, "No such file or directory", argv[0])


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


# ---- scontrol, inside a job ----------------------------------------------------------------


JOB_ENV = {"SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}


@pytest.fixture
def in_job(monkeypatch):
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_the_job_hosts_come_from_scontrol_show_hostnames(slurm, in_job):
    calls = slurm(lambda argv: done(argv, out="gpu01\ngpu02\n"))
    env = SlurmEnv.from_environ()
    assert calls == [["scontrol", "show", "hostnames", "gpu[01-02]"]]
    assert (env.job_id, env.node_index, env.n_nodes, env.hostnames, env.requeue_id) == (
        812, 1, 2, ["gpu01", "gpu02"], "812")


def test_an_array_task_is_requeued_by_its_own_id(slurm, in_job):
    slurm(lambda argv: done(argv, out="gpu01\ngpu02\n"))
    in_job.setenv("SLURM_ARRAY_JOB_ID", "800")
    in_job.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert SlurmEnv.from_environ().requeue_id == "800_3"


@pytest.mark.parametrize("reply", [missing, lambda argv: done(argv, 1, err="scontrol: error: bad nodelist")],
                         ids=["scontrol missing", "scontrol failing"])
def test_without_scontrol_the_nodelist_is_expanded_here(slurm, in_job, reply):
    """A container image without scontrol: the compressed list was taken for one host name, and
    every rank then failed to resolve `gpu[01-02]`."""
    slurm(reply)
    assert SlurmEnv.from_environ().hostnames == ["gpu01", "gpu02"]


@pytest.mark.parametrize("nodelist,hosts", [
    ("node7", ["node7"]),
    ("gpu[01-02,07],cpu-r[1-2]n1", ["gpu01", "gpu02", "gpu07", "cpu-r1n1", "cpu-r2n1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),  # the width is the low end's, as scontrol pads
    ("x[1-2]y[3-4]", ["x1y3", "x1y4", "x2y3", "x2y4"]),
])
def test_host_lists_expand_as_scontrol_does(nodelist, hosts):
    from hpc.launch.slurm_env import expand_hostlist

    assert expand_hostlist(nodelist) == hosts


def test_outside_a_job_the_stage_says_how_to_run_it(in_job):
    in_job.delenv("SLURM_JOB_ID")
    with pytest.raises(UserError, match="no SLURM_JOB_ID"):
        SlurmEnv.from_environ()


def test_requeue_says_requeued(slurm, capsys):
    calls = slurm(lambda argv: done(argv))
    stages.requeue(SlurmEnv(812, 0, 2, ["a", "b"], "800_3"))
    assert calls == [["scontrol", "requeue", "800_3"]]
    assert capsys.readouterr().out == "job 800_3: checkpointed; requeued\n"


def test_a_refused_requeue_is_one_line_with_scontrols_reason(slurm, capsys):
    slurm(lambda argv: done(argv, 1, err="scontrol: warning: x\nslurm_requeue error: Job is no longer pending\n"))
    stages.requeue(SlurmEnv(812, 0, 2, ["a", "b"], "812"))
    assert capsys.readouterr().out == ("job 812: checkpointed; requeue failed: "
                                       "slurm_requeue error: Job is no longer pending\n")


# ---- squeue, sbatch and scrontab behind `dspark schedule` ---------------------------------


SQUEUE = ("901|dspark-schedule-nightly|PENDING|2026-12-02T03:00:00|/shared/runs/slurm/schedule/nightly-901.out\n"
          "902|other-job|RUNNING|2026-12-01T05:00:00|/home/u/slurm-902.out\n"
          "903|dspark-schedule-weekly|RUNNING|2026-12-01T04:00:00|/shared/a|b/schedule/weekly-903.out\n"
          "garbage line\n")


def test_schedule_jobs_parses_squeue_and_keeps_ours(slurm):
    calls = slurm(lambda argv: done(argv, out=SQUEUE))
    assert ss.schedule_jobs() == [
        ss.ScheduleJob("901", "nightly", "PENDING", "2026-12-02T03:00:00", "/shared/runs/slurm/schedule"),
        ss.ScheduleJob("903", "weekly", "RUNNING", "2026-12-01T04:00:00", "/shared/a|b/schedule")]  # a "|" in a path
    assert [j.job_id for j in ss.schedule_jobs("weekly")] == ["903"]
    assert calls[0] == ["squeue", "--me", "-h", "-O", "JobID:|,Name:|,State:|,StartTime:|,STDOUT:"]


@pytest.mark.parametrize("reply,needle", [
    (missing, "squeue not found; run dspark schedule on a Slurm login node"),
    (lambda argv: done(argv, 1, err="squeue: error: x\nslurm_load_jobs error: Unable to contact slurm controller\n"),
     "squeue failed: slurm_load_jobs error: Unable to contact slurm controller"),
], ids=["missing", "failing"])
def test_squeue_errors_are_one_line(slurm, reply, needle):
    slurm(reply)
    with pytest.raises(UserError) as info:
        ss.schedule_jobs()
    assert one_line(info.value) == needle


def entry(tmp_path, account: str | None = "proj") -> ss.Entry:
    return ss.Entry("nightly", "0 3 * * *", "/abs/cfg.yaml", str(tmp_path / "logs" / "nightly.overrides.json"),
                    "gpu", account, str(tmp_path), "python3", str(tmp_path / "logs"))


def test_submit_singleton_passes_the_schedule_and_returns_the_job_id(slurm, tmp_path):
    calls = slurm(lambda argv: done(argv, out="4242;cluster\n"))
    job = ss.submit_singleton(entry(tmp_path), datetime.datetime(2026, 12, 2, 3, 0))
    assert job == "4242"
    argv = calls[0]
    assert argv[:3] == ["sbatch", "--parsable", "--job-name=dspark-schedule-nightly"]
    assert "--dependency=singleton" in argv and "--begin=2026-12-02T03:00:00" in argv
    assert argv[argv.index("-A") + 1] == "proj" and argv[argv.index("-p") + 1] == "gpu"
    assert (tmp_path / "logs").is_dir()  # sbatch cannot open --output in a missing directory


def test_submit_singleton_without_an_account_leaves_slurm_to_pick_it(slurm, tmp_path):
    calls = slurm(lambda argv: done(argv, out="77\n"))
    assert ss.submit_singleton(entry(tmp_path, account=None), datetime.datetime(2026, 12, 2)) == "77"
    assert "-A" not in calls[0]


@pytest.mark.parametrize("reply,needle", [
    (missing, "sbatch not found; run dspark schedule on a Slurm login node"),
    (lambda argv: done(argv, 1, err="sbatch: error: Batch job submission failed: Invalid account\n"),
     "sbatch refused the schedule job: sbatch: error: Batch job submission failed: Invalid account; "
     "check cluster.partition / cluster.account"),
], ids=["missing", "refused"])
def test_sbatch_errors_are_one_line(slurm, tmp_path, reply, needle):
    slurm(reply)
    with pytest.raises(UserError) as info:
        ss.submit_singleton(entry(tmp_path), datetime.datetime(2026, 12, 2))
    assert one_line(info.value) == needle


def test_scrontab_missing_means_the_job_fallback(slurm):
    slurm(missing)
    with pytest.raises(ss.ScrontabUnavailable, match="not installed"):
        ss.read_scrontab()


def test_scrontab_failing_otherwise_is_one_line(slurm):
    err = "scrontab: error: x\nslurm_load_ctl_conf error: Unable to contact slurm controller\n"
    slurm(lambda argv: done(argv, 1, err=err))
    with pytest.raises(UserError) as info:
        ss.read_scrontab()
    assert one_line(info.value) == ("scrontab -l failed: slurm_load_ctl_conf error: Unable to contact slurm controller; "
                                    "check `scrontab -l` on this login node")


# ---- run_slurm: the one wrapper all of the above go through ------------------------------


def test_run_slurm_returns_the_output_and_hides_the_users_sinfo_filters(monkeypatch):
    seen: dict = {}

    def run(argv, **kw):
        seen.update(kw, argv=argv)
        return done(argv, out="gpu*|4|infinite|up\n")
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("SINFO_PARTITION", "other")
    res = run_slurm(["sinfo", "-h"], timeout=5)
    assert res.stdout == "gpu*|4|infinite|up\n" and seen["argv"] == ["sinfo", "-h"]
    assert seen["timeout"] == 5 and seen["text"] and seen["capture_output"] and "SINFO_PARTITION" not in seen["env"]


def test_run_slurm_missing_program_is_one_line_and_its_own_kind(slurm):
    slurm(missing)
    with pytest.raises(SlurmMissing) as info:
        run_slurm(["sacctmgr", "show", "account"])
    assert one_line(info.value) == "sacctmgr not found: run this on a Slurm login node"
    with pytest.raises(SlurmMissing, match=r"^squeue not found; run dspark \{x\} here$"):
        run_slurm(["squeue"], missing="{prog} not found; run dspark {x} here")  # other braces stay as they are


def test_run_slurm_without_an_answer_is_one_line(slurm):
    def hang(argv):
        raise subprocess.TimeoutExpired(argv, 7.5)
    slurm(hang)
    with pytest.raises(UserError) as info:
        run_slurm(["sinfo"], timeout=7.5)
    assert not isinstance(info.value, SlurmMissing)
    assert one_line(info.value) == "sinfo did not answer within 8 s: is slurmctld up? (check with `scontrol ping`)"


@pytest.mark.parametrize("out,err,why", [
    ("", "sbatch: error: x\nsbatch: error: Invalid partition name specified\n",
     "sbatch: error: Invalid partition name specified"),
    ("only stdout says why\n", "", "only stdout says why"),
    ("", "", "exit 2"),
], ids=["stderr", "stdout", "silent"])
def test_run_slurm_failure_names_the_last_line(slurm, out, err, why):
    slurm(lambda argv: done(argv, 2, out, err))
    with pytest.raises(UserError) as info:
        run_slurm(["sbatch", "job.sh"])
    assert one_line(info.value) == f"sbatch failed (exit 2): {why}"
    with pytest.raises(UserError, match=rf"^refused: {why}; fix it$"):
        run_slurm(["sbatch", "job.sh"], failed="refused: {why}; fix it")
    assert run_slurm(["sbatch", "job.sh"], check=False).returncode == 2  # the caller judges


def test_a_requeue_without_scontrol_says_so_in_the_log_instead_of_crashing(slurm, capsys):
    slurm(missing)
    stages.requeue(SlurmEnv(812, 0, 2, ["a", "b"], "812"))
    assert capsys.readouterr().out == "job 812: checkpointed; scontrol not found: run this on a Slurm login node\n"


def test_scrontab_without_an_answer_is_a_user_error_not_a_traceback(slurm):
    def hang(argv):
        raise subprocess.TimeoutExpired(argv, ss.TIMEOUT_S)
    slurm(hang)
    with pytest.raises(UserError, match="scrontab did not answer within 60 s"):
        ss.read_scrontab()
