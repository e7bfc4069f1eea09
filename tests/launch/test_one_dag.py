"""One DAG (issue 47, item 1): every way a pipeline runs runs the stage table's jobs, in its
order: `dspark submit`, each sbatch/ script, the scheduled retrain's tick and the demo (the demo
in tests/dev/test_demo.py). The sbatch scripts run as Slurm would run their batch step, with
`srun` a recorder: which stage each step runs, and on how many nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.launch.launch_checks import resolve
from hpc.launch.stage_table import jobs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/toy-cpu.yaml"


def overrides(tmp: Path, toy_target: Path) -> list[str]:
    (tmp / "train.jsonl").write_text("{}\n")  # validation wants the file to exist
    return [f"verifier.model={toy_target}", "verifier.backend=hf", f"train.output_dir={tmp / 'out'}",
            f"data.sources=[{{path: {tmp / 'train.jsonl'}}}]", f"data.output_dir={tmp / 'data'}",
            "data.regenerate=true", "eval.adaptive=true", "cluster.regenerate_nodes=2",
            f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", "tracking.allow_file_store=true"]


def table(tmp: Path, toy_target: Path) -> list[str]:
    return [j.name for j in jobs(resolve(CONFIG, overrides(tmp, toy_target), check_tracking=False))]


def batch_step(tmp: Path, script: str, args: list[str], nodes: int = 2, env: dict | None = None) -> list[str]:
    """The script's batch step; returns one line per srun: `NODES STAGE [--n N]`."""
    stub, calls = tmp / "bin", tmp / "srun.log"
    stub.mkdir(exist_ok=True)
    calls.unlink(missing_ok=True)
    (stub / "srun").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (stub / "srun").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_NNODES": str(nodes),
               "SLURM_JOB_NODELIST": "node[1-2]", "DSPARK_PYTHON": sys.executable, "DSPARK_PARENT_RUN_ID": "parent-1",
               **(env or {})}
    run_env.pop("SLURM_RESTART_COUNT", None)
    res = subprocess.run(["bash", f"sbatch/{script}", CONFIG, *args], cwd=ROOT, env=run_env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = []
    for line in calls.read_text().splitlines() if calls.exists() else []:
        nodes_arg = line.split("--nodes=")[1].split()[0]
        stage_and_n = line.split(" stage ")[1].split()[0] + (f" n={line.split(' --n ')[1].split()[0]}"
                                                            if " --n " in line else "")
        out.append(f"{nodes_arg} {stage_and_n}")
    return out


def test_submit_lays_out_the_tables_jobs(tmp_path, toy_target):
    from hpc.launch.submit import plan_pipeline

    cfg, p = plan_pipeline(CONFIG, overrides(tmp_path, toy_target))
    assert [s.name for s in p.stages] == table(tmp_path, toy_target)
    assert [s.name for s in p.stages] == ["regenerate", "train", "calibrate", "eval-n3", "eval-n7", "eval-adaptive",
                                          "report"]


def test_the_retrain_script_runs_every_stage_submit_would_eval_adaptive_included(tmp_path, toy_target):
    ran = batch_step(tmp_path, "retrain.sbatch", overrides(tmp_path, toy_target))
    assert [r.split()[1] for r in ran] == ["regenerate", "train", "calibrate", "eval", "eval", "eval-adaptive",
                                           "report"]
    names = [r.split()[1] + (f"-n{r.split('n=')[1]}" if "n=" in r else "") for r in ran]
    assert names == table(tmp_path, toy_target)
    # each step on the nodes its row asks for: Ray over regenerate_nodes, training over V + T
    assert [r.split()[0] for r in ran] == ["2", "2", "1", "1", "1", "1", "1"]


@pytest.mark.parametrize("script, env, want", [
    ("train.sbatch", {}, ["2 train"]),
    ("calibrate.sbatch", {}, ["1 calibrate"]),
    ("eval.sbatch", {"N": "3"}, ["1 eval n=3"]),
    ("eval.sbatch", {"N": "5"}, ["1 eval n=5"]),  # an n off the config's list, as `dspark stage eval --n` takes
    ("report.sbatch", {}, ["1 report"]),
])
def test_each_stage_script_runs_its_stage_of_the_table(tmp_path, toy_target, script, env, want):
    assert batch_step(tmp_path, script, overrides(tmp_path, toy_target), env=env) == want


def test_the_retrain_tick_submits_the_same_pipeline(tmp_path, toy_target, monkeypatch):
    """A scheduled retrain's tick hands submit the config and its own overrides (new data's
    directory, a warm start): the stages it chains are the table's for that config."""
    import hpc.launch.submit as submit_mod
    from hpc.launch.retrain import submit_retrain
    from hpc.launch.submit import plan_pipeline

    laid_out: list[list[str]] = []

    def recording_submit(config, extra, dry=False, extra_tags=None):
        cfg, p = plan_pipeline(config, extra)
        laid_out.append([s.name for s in p.stages])
        assert [s.name for s in p.stages] == [j.name for j in jobs(cfg)]
        return 0

    monkeypatch.setattr(submit_mod, "submit", recording_submit)
    over = overrides(tmp_path, toy_target)
    cfg = resolve(CONFIG, over, check_tracking=False)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)  # the registry it asks for a champion: none yet
    assert submit_retrain(CONFIG, over, cfg, client, "f" * 64, "new data", {}, []) == 0
    assert laid_out == [table(tmp_path, toy_target)]


def test_submit_ablations_is_one_train_job_of_three_drafts_each_evaluated_under_its_name(tmp_path, toy_target):
    """`dspark submit --ablations`: one allocation of V + 3 x T nodes trains DSpark, DFlash and
    Markov-only; calibrate and every eval are arrays of three, each under its draft's name; only
    DSpark's variant (the one with a confidence head) runs adaptive verification."""
    from hpc.config import load_config, to_object
    from hpc.launch.submit import plan_pipeline

    cfg, p = plan_pipeline(CONFIG, [*overrides(tmp_path, toy_target), "submit.ablations=true"])
    by = {s.name: s for s in p.stages}
    assert [s.name for s in p.stages] == table(tmp_path, toy_target)  # the same table, with three variants
    assert by["train"].params["nodes"] == cfg.cluster.verifier_nodes + 3 * cfg.cluster.trainer_nodes
    assert len(by["train"].calls) == 1 and len(by["train"].calls[0][3]) == 2  # one job; two configs ride along
    assert all(len(by[s].calls) == 3 for s in ("calibrate", "eval-n3", "eval-n7", "eval-adaptive"))
    variants = [to_object(load_config(f, [])) for f in p.variant_files]
    assert [v.eval.label for v in variants] == ["DSpark", "DFlash", "Markov-only"]
    assert [v.eval.adaptive for v in variants] == [True, False, False]
    assert [v.draft.enable_confidence_head for v in variants] == [True, False, False]


@pytest.mark.parametrize("extra, says", [(["sweep={train.lr: [0.001, 0.0003]}"], "sweep over train.lr"),
                                         (["submit.ablations=true"], "submit.ablations")])
def test_stage_all_refuses_a_config_of_many_variants_rather_than_train_its_base_alone(tmp_path, toy_target,
                                                                                      monkeypatch, extra, says):
    """An sbatch script runs one config; a sweep's other variants would be dropped without a word."""
    from hpc.errors import UserError
    from hpc.launch.stage_all import run_all

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(UserError) as err:
        run_all(CONFIG, [*overrides(tmp_path, toy_target), *extra])
    line = str(err.value)
    assert line.startswith(says) and "dspark submit" in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()  # refused before a directory or a step exists
