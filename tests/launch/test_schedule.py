"""`dspark schedule` and `dspark retrain-tick`: the scrontab table (mocked scrontab), the
self-resubmitting job on the real dev cluster, and the new-data check against a real MLflow
server. The cron parser has its own tests in test_cron.py."""

from __future__ import annotations

import datetime
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.launch import retrain, schedule
from hpc.launch import submit as launch_submit
from hpc.launch.cron import next_run
from tests.fixtures.wait import poll

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "toy-cpu.yaml")
D = datetime.datetime


# ---- configs -----------------------------------------------------------------------------------


def toy_overrides(tmp: Path, uri: str, name: str, partition: str = "debug") -> list[str]:
    data = tmp / "train.jsonl"
    if not data.exists():
        data.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    # verifier.* need not exist: nothing here loads the target.
    return [f"name={name}", f"cluster.partition={partition}", f"cluster.log_dir={tmp / 'slurm'}",
            "verifier.model=toy/qwen3", "verifier.backend=hf", f"data.sources=[{{path: {data}}}]",
            f"data.output_dir={tmp / 'data'}", f"train.output_dir={tmp / 'train'}", f"tracking.uri={uri}",
            f"tracking.experiment={name}", f"tracking.registered_model={name}-draft",
            *(["tracking.allow_file_store=true"] if uri.startswith("sqlite") else [])]


class FakeSlurm:
    """subprocess.run for scrontab/squeue/sbatch, remembering the table and every call."""

    def __init__(self, table: str | None = None, scrontab_error: str | None = None):
        self.table, self.error, self.calls = table, scrontab_error, []

    def __call__(self, argv, **_):
        argv = list(argv)
        self.calls.append(argv)
        ok = subprocess.CompletedProcess(argv, 0, "", "")
        if argv[0] == "scrontab" and self.error:
            return subprocess.CompletedProcess(argv, 1, "", self.error)
        if argv == ["scrontab", "-l"]:
            if self.table is None:
                return subprocess.CompletedProcess(argv, 1, "no crontab for root\n", "")
            return subprocess.CompletedProcess(argv, 0, self.table, "")
        if argv == ["scrontab", "-r"]:
            self.table = None
            return ok
        if argv[0] == "scrontab":
            self.table = Path(argv[1]).read_text()
            return ok
        if argv[0] == "squeue":
            return ok
        if argv[0] == "sbatch":
            return subprocess.CompletedProcess(argv, 0, "4242;dev\n", "")
        raise AssertionError(f"unexpected command {argv}")


@pytest.fixture
def fake_slurm(monkeypatch):
    import croniter  # noqa: F401  (imported lazily by hpc.launch.cron; its import runs `file`, which the fake refuses)

    def make(**kw) -> FakeSlurm:
        fake = FakeSlurm(**kw)
        monkeypatch.setattr(subprocess, "run", fake)
        return fake
    return make


def tick_line(tmp: Path, name: str = "toy") -> str:
    saved = str(tmp / "slurm" / "schedule" / f"{name}.overrides.json")
    tick = [sys.executable, "-m", "hpc", "retrain-tick", CONFIG, "--overrides-file", saved]
    return f"0 3 * * 0 cd {ROOT} && {shlex.join(tick)}"


def saved_overrides(tmp: Path, name: str = "toy") -> list[str]:
    """The schedule's overrides file: owner-only, and what the tick reads back."""
    import json
    import stat

    path = tmp / "slurm" / "schedule" / f"{name}.overrides.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return json.loads(path.read_text())["overrides"]


def test_scrontab_install_writes_the_block(fake_slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    fake = fake_slurm()  # no table yet: "no crontab for root"
    ov = toy_overrides(tmp_path, f"sqlite:///{tmp_path}/m.db", "toy", "debug") + ["cluster.account=acct"]
    assert schedule.install(CONFIG, ov, "0 3 * * 0") == 0
    assert fake.table == "\n".join([
        "# dspark-schedule toy begin", "#SCRON -p debug", "#SCRON -A acct", "#SCRON -t 00:30:00",
        f"#SCRON -o {tmp_path}/slurm/schedule/toy-%j.out", tick_line(tmp_path),
        "# dspark-schedule toy end"]) + "\n"
    assert saved_overrides(tmp_path) == ov
    assert "scrontab entry '0 3 * * 0'" in capsys.readouterr().out


def test_scrontab_reinstall_replaces_only_its_block(fake_slurm, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    other = ["# dspark-schedule other begin", "#SCRON -p debug", "0 1 * * * echo other",
             "# dspark-schedule other end"]
    old = ["# dspark-schedule toy begin", "#SCRON -p gpu", "0 4 * * * echo old", "# dspark-schedule toy end"]
    fake = fake_slurm(table="\n".join(["MAILTO=me", "*/5 * * * * echo mine", *old, *other]) + "\n")
    ov = toy_overrides(tmp_path, f"sqlite:///{tmp_path}/m.db", "toy")
    schedule.install(CONFIG, ov, "0 3 * * 0")
    assert fake.table.splitlines() == [
        "MAILTO=me", "*/5 * * * * echo mine",
        "# dspark-schedule toy begin", "#SCRON -p debug", "#SCRON -t 00:30:00",
        f"#SCRON -o {tmp_path}/slurm/schedule/toy-%j.out", tick_line(tmp_path), "# dspark-schedule toy end",
        *other]
    assert schedule.list_schedules().splitlines() == [
        f"{'other':<24} scrontab  '0 1 * * *'  no tick yet", f"{'toy':<24} scrontab  '0 3 * * 0'  no tick yet"]
    # A tick leaves its trigger and decision beside the schedule's logs, where the list finds them.
    (tmp_path / "slurm" / "schedule" / "toy.last.json").write_text(
        '{"trigger": "both", "at": 1800000000, "lines": ["live tau 1.2 ...: drift; firing", "no new data"]}')
    when = D.fromtimestamp(1800000000).strftime("%Y-%m-%d %H:%M")
    assert schedule.list_schedules().splitlines()[1] == (
        f"{'toy':<24} scrontab  '0 3 * * 0'  trigger both; last tick {when}: live tau 1.2 ...: drift; firing / no new data")
    assert schedule.remove("toy") == 0
    assert fake.table.splitlines() == ["MAILTO=me", "*/5 * * * * echo mine", *other]
    assert schedule.remove("other") == 0 and fake.table.splitlines() == ["MAILTO=me", "*/5 * * * * echo mine"]
    with pytest.raises(UserError, match="^--remove toy: no schedule of that name"):
        schedule.remove("toy")


def test_scrontab_remove_of_the_last_block_clears_the_table(fake_slurm):
    fake = fake_slurm(table="# dspark-schedule toy begin\n0 3 * * 0 true\n# dspark-schedule toy end\n")
    schedule.remove("toy")
    assert ["scrontab", "-r"] in fake.calls and fake.table is None
    assert schedule.list_schedules() == "no scheduled retraining (see dspark schedule --help)\n"


def test_disabled_scrontab_falls_back_to_a_singleton_job(fake_slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    fake = fake_slurm(scrontab_error="scrontab: fatal: scrontab is disabled on this cluster\n")
    ov = toy_overrides(tmp_path, f"sqlite:///{tmp_path}/m.db", "toy")
    before = D.now().replace(microsecond=0)
    schedule.install(CONFIG, ov, "*/10 * * * *")
    after = D.now()
    sbatch = next(c for c in fake.calls if c[0] == "sbatch")
    assert "--job-name=dspark-schedule-toy" in sbatch and "--dependency=singleton" in sbatch
    begin = D.fromisoformat(next(a for a in sbatch if a.startswith("--begin="))[len("--begin="):])
    # The next firing after install: a 10-minute boundary passing during install cannot fail this.
    assert begin.minute % 10 == 0 and before < begin and (begin - after).total_seconds() <= 600
    wrap = next(a for a in sbatch if a.startswith("--wrap="))
    assert f"-m hpc retrain-tick {CONFIG}" in wrap and "--cron '*/10 * * * *' --resubmit" in wrap
    out = capsys.readouterr().out
    assert "scrontab unavailable (scrontab: fatal: scrontab is disabled on this cluster)" in out
    assert "job 4242 runs `dspark retrain-tick`" in out


@pytest.mark.parametrize("scrontab", ["enabled", "disabled"])
def test_overrides_never_reach_a_command_line(fake_slurm, tmp_path, monkeypatch, scrontab):
    """The scrontab line, sbatch --wrap and each tick's argv are readable by every user of the
    node: a schedule's overrides (a token among them) travel in its owner-only file."""
    import argparse
    import secrets

    monkeypatch.chdir(ROOT)
    token = f"hf_{secrets.token_hex(16)}"
    fake = fake_slurm(scrontab_error=None if scrontab == "enabled" else "scrontab is disabled on this cluster")
    ov = [*toy_overrides(tmp_path, f"sqlite:///{tmp_path}/m.db", "toy"), f"verifier.env.HF_TOKEN={token}"]
    assert schedule.install(CONFIG, ov, "0 3 * * 0") == 0
    written = [fake.table or "", *(" ".join(c) for c in fake.calls)]
    assert not any(token in w for w in written) and saved_overrides(tmp_path) == ov
    # What the entry or the job runs gets them back, and argv's come after (they win).
    parser = argparse.ArgumentParser()
    schedule.register_tick(parser.add_subparsers())
    saved = str(tmp_path / "slurm" / "schedule" / "toy.overrides.json")
    assert saved in "".join(written)
    a = parser.parse_args(["retrain-tick", CONFIG, "train.steps=3", "--overrides-file", saved])
    assert schedule._overrides(a) == [*ov, "train.steps=3"]
    # A file others may read (or one another user planted) is refused, in one line.
    Path(saved).chmod(0o644)
    with pytest.raises(UserError, match="is not an owner-only file of yours"):
        schedule._overrides(a)


@pytest.mark.parametrize("tick_rc, submit_rc, job_rc", [(0, 0, 0), (3, 0, 3), (0, 1, 1), (124, 0, 124)])
def test_the_fallback_job_submits_its_successor_before_the_tick(tmp_path, tick_rc, submit_rc, job_rc):
    """A tick that fails, or is killed at the job's time limit (124 here), must not end the schedule."""
    from hpc.launch.schedule_slurm import Entry

    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
case "$*" in
  *retrain-tick*) echo tick >> {log}; exit {tick_rc} ;;
  *--resubmit*) echo successor >> {log}; exit {submit_rc} ;;
esac
""")
    fake.chmod(0o755)
    e = Entry("t", "0 3 * * 0", "/cfg.yaml", cwd=str(tmp_path), python=str(fake))
    res = subprocess.run(["bash", "-c", e.resubmitting_command()], capture_output=True, text=True)
    assert log.read_text().split() == ["successor", "tick"] and res.returncode == job_rc


# ---- the real cluster: scrontab is not enabled there, so the job fallback runs --------------------


def dspark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def queued(name: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", "-n", f"dspark-schedule-{name}", "-o", "%i %S %T"],
                         capture_output=True, text=True, check=True).stdout
    return [line.split() for line in out.splitlines()]


def test_fallback_job_on_the_real_cluster(slurm_cluster, mlflow_server, tmp_path):
    probe = subprocess.run(["sh", "-c", "scrontab -l"], capture_output=True, text=True)
    assert probe.returncode != 0, "scrontab is enabled on the dev cluster: this test expects the fallback"
    name = f"sched-{uuid.uuid4().hex[:8]}"
    ov = toy_overrides(tmp_path, mlflow_server.uri, name, slurm_cluster.partition)
    try:
        res = dspark("schedule", CONFIG, *ov, "--cron", "0 3 * * 0")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "self-resubmitting job" in res.stdout
        [[first, start, state]] = queued(name)
        assert state == "PENDING" and D.fromisoformat(start) == next_run("0 3 * * 0", D.now())
        res = dspark("schedule", CONFIG, *ov, "--cron", "0 3 * * 0")  # again: replaces, never two
        assert res.returncode == 0, res.stderr[-2000:]
        [[second, start2, _]] = queued(name)
        assert second != first and start2 == start
        listing = dspark("schedule", "--list")
        assert listing.returncode == 0 and any(
            line.split()[:3] == [name, "job", second] and line.endswith(f"starts {start}  no tick yet")
            for line in listing.stdout.splitlines()), listing.stdout
        res = dspark("schedule", "--remove", name)
        assert res.returncode == 0 and f"schedule {name}: removed job {second}" in res.stdout, res.stderr
        assert queued(name) == []
    finally:
        subprocess.run(["scancel", "-n", f"dspark-schedule-{name}"], capture_output=True)


def test_the_tick_job_runs_and_resubmits_itself(slurm_cluster, mlflow_server, tmp_path, monkeypatch):
    name = f"loop-{uuid.uuid4().hex[:8]}"
    ov = toy_overrides(tmp_path, mlflow_server.uri, name, slurm_cluster.partition)
    fake_submit(monkeypatch)
    retrain.retrain_tick(CONFIG, ov)  # a scheduled run with this data: the job's tick has nothing to do
    try:
        res = dspark("schedule", CONFIG, *ov, "--cron", "* * * * *")
        assert res.returncode == 0, res.stderr[-2000:]
        [[first, _, _]] = queued(name)
        # Until the first job has ended, its successor waiting.
        poll(lambda: [j[0] for j in queued(name)], lambda ids: bool(ids) and first not in ids, 240, 5)
        [[second, start, state]] = queued(name)
        assert second != first and state == "PENDING" and D.fromisoformat(start) > D.now()
        log = (tmp_path / "slurm" / "schedule" / f"{name}-{first}.out").read_text()
        # The successor is submitted before the tick runs.
        assert log.index(f"job {second} runs `dspark retrain-tick`") < log.index("no new data since "), log
    finally:
        subprocess.run(["scancel", "-n", f"dspark-schedule-{name}"], capture_output=True)


def test_the_scrontab_entry_runs_as_scrontab_would_run_it(slurm_cluster, mlflow_server, tmp_path, monkeypatch):
    """The dev cluster's Slurm (Debian) ships no scrontab binary, so the installed entry is run the
    way scrontab runs one: its #SCRON lines as sbatch options, its command as the batch script."""
    monkeypatch.chdir(ROOT)
    name = f"scron-{uuid.uuid4().hex[:8]}"
    ov = toy_overrides(tmp_path, mlflow_server.uri, name, slurm_cluster.partition)
    fake = FakeSlurm()
    monkeypatch.setattr(subprocess, "run", fake)
    assert schedule.install(CONFIG, ov, "0 3 * * 0") == 0
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)  # scrontab jobs start in the home directory: the entry must not need ROOT
    fake_submit(monkeypatch)
    retrain.retrain_tick(CONFIG, ov)  # a scheduled run with this data already exists
    lines = fake.table.splitlines()
    options = [line.removeprefix("#SCRON ") for line in lines if line.startswith("#SCRON ")]
    (entry,) = [line for line in lines if line and not line.startswith("#")]
    command = entry.split(None, 5)[5]  # after the five cron fields
    script = tmp_path / "entry.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options) + command + "\n")
    res = subprocess.run(["sbatch", "--parsable", "--wait", f"--job-name={name}", str(script)], capture_output=True,
                         text=True, timeout=300)
    job = res.stdout.strip().split(";")[0]
    log = tmp_path / "slurm" / "schedule" / f"{name}-{job}.out"
    assert res.returncode == 0, (res.stderr, log.read_text() if log.exists() else "no log")
    assert log.read_text().startswith("no new data since "), log.read_text()


def test_bad_cron_flag_is_one_line(tmp_path):
    res = dspark("schedule", CONFIG, *toy_overrides(tmp_path, f"sqlite:///{tmp_path}/m.db", "toy"), "--cron", "0 3 * *")
    assert res.returncode == 2 and res.stderr.startswith("error: schedule.cron = '0 3 * *': has 4 field(s), not 5")
    assert len(res.stderr.splitlines()) == 1



@pytest.mark.parametrize("cron", ["0 3 * *\n0", "0 3 * * 0\n* * * * * touch /tmp/x", "0 3 * * 0 % x", "0 3 * * 0;"])
def test_a_cron_that_would_add_a_crontab_line_is_refused(cron):
    with pytest.raises(UserError, match="schedule.cron = .*have no place in a cron expression"):
        schedule.check_cron(cron)


@pytest.mark.parametrize("field_name,value", [
    ("cwd", "/home/u/a\n* * * * * touch /tmp/pwned #"), ("cwd", "/home/u/50%"), ("config", "/c\r.yaml"),
    ("overrides_file", "/o\n* * * * * id"), ("partition", "gpu -o /tmp/x"), ("log_dir", "runs/x\ny"),
])
def test_a_value_that_would_break_its_scrontab_line_is_refused(field_name, value):
    from hpc.launch.schedule_slurm import Entry, scrontab_block

    fine = Entry("t", "0 3 * * 0", "/cfg.yaml", cwd="/home/u/project dir")  # a plain space is quoted, not refused
    assert len(scrontab_block(fine)) == 6
    with pytest.raises(UserError, match="would break its scrontab line"):
        scrontab_block(Entry(**{**fine.__dict__, field_name: value}))


# ---- retrain-tick: new data or not -----------------------------------------------------------------


def register_champion(uri: str, experiment: str, model_name: str, tmp: Path) -> str:
    from mlflow.tracking import MlflowClient

    from hpc.model.dspark import DSparkDraft
    from hpc.model.export import export_draft
    from hpc.track.registry import promote_if_better, register_draft
    from tests.fixtures.draft import toy_draft_args

    client = MlflowClient(uri)
    export = export_draft(DSparkDraft(toy_draft_args()), tmp / "export", "toy", [], 7)
    exp = client.get_experiment_by_name(experiment)
    run_id = client.create_run(exp.experiment_id).info.run_id
    client.log_artifacts(run_id, str(export), "draft")
    version = register_draft(client, model_name, run_id, "draft", 3.0, {"gsm8k": "a" * 64})
    promote_if_better(client, model_name, version)
    return version


def fake_submit(monkeypatch) -> list[tuple[list[str], dict]]:
    """submit (which a tick loads when it submits) records its calls and creates the parent run (with its tags), no jobs."""
    from mlflow.tracking import MlflowClient

    from hpc.launch.launch_checks import resolve
    from hpc.track import pipeline

    monkeypatch.setattr(pipeline, "git_sha", lambda: "test")
    calls: list[tuple[list[str], dict]] = []

    def fake(config, overrides, dry=False, extra_tags=None):
        cfg = resolve(config, overrides, check_tracking=False)  # what submit would accept
        pipeline.create_pipeline_run(MlflowClient(cfg.tracking.uri), cfg, f"{cfg.name}-{len(calls)}", extra_tags)
        calls.append((list(overrides), dict(extra_tags or {})))
        return 0

    monkeypatch.setattr(launch_submit, "submit", fake)
    return calls


def test_retrain_tick_submits_only_on_new_data(mlflow_server, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from hpc.launch.launch_checks import resolve

    calls = fake_submit(monkeypatch)
    name = f"tick-{uuid.uuid4().hex[:8]}"
    ov = toy_overrides(tmp_path, mlflow_server.uri, name)
    fp = retrain.data_fingerprint(resolve(CONFIG, ov).data)

    assert retrain.retrain_tick(CONFIG, ov) == 0  # nothing recorded yet: submit, no champion to start from
    [(first, tags)] = calls
    assert first == [*ov, f"data.output_dir={tmp_path / 'data' / f'data-{fp[:12]}'}"]
    assert tags == {"dspark.scheduled": "true", "dspark.data_fingerprint": fp, "dspark.trigger": "cron"}
    capsys.readouterr()

    assert retrain.retrain_tick(CONFIG, ov) == 0  # same data
    last = retrain.last_scheduled_run(MlflowClient(mlflow_server.uri), resolve(CONFIG, ov))
    assert capsys.readouterr().out.splitlines() == [f"no new data since {name}-0 (run {last.run_id})"]
    assert len(calls) == 1

    version = register_champion(mlflow_server.uri, name, f"{name}-draft", tmp_path)
    with (tmp_path / "train.jsonl").open("a") as f:
        f.write('{"conversations": [{"from": "human", "value": "new"}, {"from": "gpt", "value": "row"}]}\n')
    fp2 = retrain.data_fingerprint(resolve(CONFIG, ov).data)
    assert fp2 != fp
    assert retrain.retrain_tick(CONFIG, ov) == 0
    second, tags2 = calls[1]
    assert "train.init_from=champion" in second and f"data.output_dir={tmp_path / 'data' / f'data-{fp2[:12]}'}" in second
    assert tags2 == {"dspark.scheduled": "true", "dspark.data_fingerprint": fp2, "dspark.trigger": "cron",
                     "dspark.warm_start": f"{name}-draft v{version}"}

    res = dspark("retrain-tick", CONFIG, *ov)  # the command the schedule runs; nothing new since
    last = retrain.last_scheduled_run(MlflowClient(mlflow_server.uri), resolve(CONFIG, ov))
    assert res.returncode == 0 and res.stdout.splitlines() == [f"no new data since {name}-1 (run {last.run_id})"]
    assert len(calls) == 2

    # That pipeline failed: the data is not covered, so the next tick submits it again.
    MlflowClient(mlflow_server.uri).set_terminated(last.run_id, "FAILED")
    capsys.readouterr()
    assert retrain.retrain_tick(CONFIG, ov) == 0
    said = capsys.readouterr().out.splitlines()[0]
    assert said == f"{name}-1 (run {last.run_id}) ended FAILED on this data: submitting it again"
    assert len(calls) == 3 and calls[2][1]["dspark.data_fingerprint"] == fp2
    # One a person cancelled stays cancelled until the data changes.
    client = MlflowClient(mlflow_server.uri)
    cancelled = retrain.last_scheduled_run(client, resolve(CONFIG, ov))
    client.set_terminated(cancelled.run_id, "KILLED")
    assert retrain.retrain_tick(CONFIG, ov) == 0 and len(calls) == 3

    # Failing again and again: schedule.retries (2) resubmissions after the first failure, then it waits.
    client.set_terminated(cancelled.run_id, "FAILED")
    assert retrain.last_scheduled_run(client, resolve(CONFIG, ov)).failures == 2
    assert retrain.retrain_tick(CONFIG, ov) == 0 and len(calls) == 4
    client.set_terminated(retrain.last_scheduled_run(client, resolve(CONFIG, ov)).run_id, "FAILED")
    capsys.readouterr()
    assert retrain.retrain_tick(CONFIG, ov) == 0 and len(calls) == 4
    assert capsys.readouterr().out.startswith("3 pipelines in a row failed on this data, the last ")


def test_fingerprint_of_files_directories_and_hub_ids(tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    from hpc.config.schema import DataSource

    monkeypatch.setattr(retrain, "hub_revision", lambda dataset: "rev1")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("a\n")
    cfg = NS(data=NS(sources=[DataSource(str(tmp_path / "d")), DataSource("org/set")]))
    fp = retrain.data_fingerprint(cfg.data)
    assert fp == retrain.data_fingerprint(cfg.data) and len(fp) == 64
    (tmp_path / "d" / "b.jsonl").write_text("b\n")  # a new file in the directory
    fp2 = retrain.data_fingerprint(cfg.data)
    assert fp2 != fp
    monkeypatch.setattr(retrain, "hub_revision", lambda dataset: "rev2")  # a new hub revision
    assert retrain.data_fingerprint(cfg.data) != fp2
    cfg.data.sources[1].split = "test"
    assert retrain.data_fingerprint(cfg.data) not in (fp, fp2)
