"""One declaration of the pipeline's stages drives submit, the demo, `dspark stage` and status."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc.errors import UserError
from hpc.launch import stage_table
from hpc.launch.stage_table import NAMES, jobs, stage, stage_of

ROOT = Path(__file__).resolve().parents[2]


def _cfg(regenerate: bool, ns=(3, 7), hold_out_every: int = 0, confidence: bool = True, calibration=(),
         adaptive: bool = False, share: bool = False):
    return SimpleNamespace(data=SimpleNamespace(regenerate=regenerate, calibration_sources=list(calibration)),
                           eval=SimpleNamespace(num_speculative_tokens=list(ns), adaptive=adaptive),
                           train=SimpleNamespace(hold_out_every=hold_out_every),
                           draft=SimpleNamespace(enable_confidence_head=confidence),
                           submit=SimpleNamespace(share_verifier=share, ablations=False),
                           sweep={"train.lr": [1e-3, 3e-4, 1e-4]})


def test_jobs_in_order_with_dependencies_resolved_to_job_names():
    got = [(j.name, j.n, j.after) for j in jobs(_cfg(regenerate=True))]
    assert got == [
        ("regenerate", None, ()),
        ("train", None, (("afterok", "regenerate"),)),
        ("eval-n3", 3, (("aftercorr", "train"),)),
        ("eval-n7", 7, (("aftercorr", "train"),)),
        ("report", None, (("afterany", "eval-n3"), ("afterany", "eval-n7"))),
    ]


def test_a_disabled_stage_drops_out_with_its_dependencies():
    got = {j.name: j.after for j in jobs(_cfg(regenerate=False, ns=(5,)))}
    assert list(got) == ["train", "eval-n5", "report"]
    assert got["train"] == ()  # no afterok on a job that is not submitted


def test_held_out_rows_put_calibrate_between_train_and_the_evals():
    got = {j.name: j.after for j in jobs(_cfg(regenerate=False, hold_out_every=50))}
    assert list(got) == ["train", "calibrate", "eval-n3", "eval-n7", "report"]
    assert got["calibrate"] == (("aftercorr", "train"),)
    assert got["eval-n7"] == (("aftercorr", "train"), ("aftercorr", "calibrate"))
    # A draft with no confidence head has nothing to calibrate: no job, and the evals wait on train only.
    got = {j.name: j.after for j in jobs(_cfg(regenerate=False, hold_out_every=50, confidence=False))}
    assert "calibrate" not in got and got["eval-n3"] == (("aftercorr", "train"),)


def test_calibration_sources_alone_bring_the_calibrate_stage():
    got = {j.name: j.after for j in jobs(_cfg(regenerate=True, calibration=[SimpleNamespace(path="cal.jsonl")]))}
    assert list(got) == ["regenerate", "train", "calibrate", "eval-n3", "eval-n7", "report"]
    assert got["calibrate"] == (("aftercorr", "train"),)  # the regenerate stage answered its rows already


def test_adaptive_chains_a_third_eval_beside_the_fixed_ns_and_the_report_waits_for_it():
    got = {j.name: j.after for j in jobs(_cfg(regenerate=False, hold_out_every=50, adaptive=True))}
    assert list(got) == ["train", "calibrate", "eval-n3", "eval-n7", "eval-adaptive", "report"]
    assert got["eval-adaptive"] == got["eval-n7"] == (("aftercorr", "train"), ("aftercorr", "calibrate"))
    assert ("afterany", "eval-adaptive") in got["report"] and ("afterany", "eval-n3") in got["report"]
    assert stage_of("eval-adaptive") == "eval-adaptive" and stage("eval-adaptive").nodes(
        SimpleNamespace(eval_nodes=1)) == 1


def test_stage_of_maps_job_names_back():
    assert [stage_of(j.name) for j in jobs(_cfg(True))] == ["regenerate", "train", "eval", "eval", "report"]
    assert stage_of("something-else") == "something-else"


def test_an_unknown_stage_names_the_known_ones():
    known = "regenerate, train, calibrate, eval, eval-adaptive, report"
    with pytest.raises(UserError, match=f"unknown stage 'evaluate'; one of {known}"):
        stage("evaluate")


def test_the_report_stage_without_a_parent_run_says_so():
    # It used to go on to MLflow with no run to read, and fail there in MLflow's words.
    with pytest.raises(UserError, match="--parent-run-id"):
        stage("report").entry(_cfg(True), None, None, False)


def test_the_stage_cli_offers_exactly_the_tables_stages(capsys):
    from hpc.cli import main

    with pytest.raises(SystemExit):
        main(["stage", "nope", "x.yaml"])
    assert "choose from " + ", ".join(repr(n) for n in NAMES) in capsys.readouterr().err


def test_submit_lays_out_the_tables_jobs(monkeypatch, tmp_path):
    # A stage added to the table reaches submit with no other edit.
    from hpc.launch import submit

    extra = stage_table.Stage("lint", lambda *a: 0, after=(("afterok", "train"),), gpus=False, per_variant=False)
    monkeypatch.setattr(stage_table, "STAGES", (*stage_table.STAGES, extra))
    cfg = SimpleNamespace(
        name="t", sweep={}, data=SimpleNamespace(regenerate=False, sources=[], calibration_sources=[]),
        eval=SimpleNamespace(num_speculative_tokens=[3], compare=[], adaptive=False, label=None),
        cluster=SimpleNamespace(partition="p", time="1:00:00", cpus_per_task=1, signal_delay_s=90, account="",
                                qos="", mem="", exclusive=False, gpus_per_node=0, sbatch_extra=[], verifier_nodes=1,
                                trainer_nodes=1, eval_nodes=1, regenerate_nodes=1, log_dir=str(tmp_path)),
        train=SimpleNamespace(output_dir=str(tmp_path / "train"), hold_out_every=0), tracking=SimpleNamespace(uri="http://x"),
        verifier=SimpleNamespace(model=str(tmp_path), revision=None, trust_remote_code=False),
        submit=SimpleNamespace(share_verifier=False, ablations=False),
    )
    monkeypatch.setattr("hpc.launch.submit.resolve", lambda *a, **k: cfg)
    monkeypatch.setattr("hpc.launch.submit.sweep_overrides", lambda c: [[]])
    monkeypatch.setattr("hpc.launch.submit.pipeline_problems", lambda c: [])
    monkeypatch.setattr("hpc.launch.submit.to_yaml", lambda c: "name: t\n")
    monkeypatch.setattr("omegaconf.OmegaConf.structured", lambda c: c)
    _, p = submit.plan_pipeline("cfg.yaml", [])
    assert [(s.name, s.after, s.array) for s in p.stages] == [
        ("train", [], True), ("eval-n3", [("aftercorr", "train")], True),
        ("report", [("afterany", "eval-n3")], False), ("lint", [("afterok", "train")], False)]
    assert p.stages[0].params["nodes"] == 2 and p.stages[0].params["slurm_srun_args"] == ["--kill-on-bad-exit=1"]


def test_a_stage_failing_inside_its_job_says_why_without_credentials(monkeypatch, capsys):
    """submitit prints a raised error's traceback into the job log: MLflow's error text quotes the
    request URL, password and all."""
    def broken(*a):
        raise ConnectionError("API request to http://alice:PW15@mlflow:5000/api/2.0/runs failed")

    monkeypatch.setattr(stage_table, "run_in_job", broken)
    with pytest.raises(UserError) as err:
        stage_table.run_stage("report", "v.yaml", "parent", None)
    assert str(err.value) == ("stage report: ConnectionError: API request to http://alice:***@mlflow:5000/api/2.0/runs "
                              "failed")
    printed = capsys.readouterr().err
    assert "Traceback (most recent call last)" in printed and "PW15" not in printed


@pytest.mark.parametrize("overrides, exclusive, mem", [
    ([], True, "0"),  # the recipe's default: whole nodes, and the node's whole memory in the cgroup
    (["cluster.exclusive=false", "cluster.mem=null"], False, None),
    (["cluster.mem=900G"], True, "900G"),
])
def test_jobs_ask_for_whole_nodes_unless_told_otherwise(tmp_path, overrides, exclusive, mem):
    from hpc.launch.submit import _base_params, _executor, sbatch_script
    from tests.fixtures.recipes import resolve_recipe

    cfg = resolve_recipe(ROOT / "configs" / "kimi-k2.6-dspark.yaml", ["cluster.account=a", *overrides])
    script = sbatch_script(_executor(tmp_path, _base_params(cfg.cluster, "k-train", 2, True), None, 1), 1)
    lines = set(script.splitlines())
    assert ("#SBATCH --exclusive" in lines) == exclusive
    assert {ln for ln in lines if ln.startswith("#SBATCH --mem")} == ({f"#SBATCH --mem={mem}"} if mem else set())


def test_a_shared_verifier_trains_every_variant_in_one_job_and_the_rest_wait_for_all_of_it():
    got = {j.name: j for j in jobs(_cfg(regenerate=False, hold_out_every=50, share=True))}
    assert not got["train"].array and got["train"].variants == 3  # one allocation, three drafts
    # A task of the calibrate array has no train task of its index to wait for: it waits for the job.
    assert got["calibrate"].array and got["calibrate"].after == (("afterok", "train"),)
    assert got["eval-n7"].after == (("afterok", "train"), ("aftercorr", "calibrate"))
    unshared = {j.name: j for j in jobs(_cfg(regenerate=False, hold_out_every=50))}
    assert unshared["train"].array and unshared["calibrate"].after == (("aftercorr", "train"),)
