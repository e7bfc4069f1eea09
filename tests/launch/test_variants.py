"""A submitted pipeline's files are private, uniquely named, and checked by every job."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.launch.submit import plan_pipeline
from hpc.launch.variants import check_variant_file
from tests.fixtures.recipes import NO_VLLM

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "configs" / "kimi-k2.6-dspark.yaml")


def _plan(tmp_path: Path, *extra: str):
    return plan_pipeline(KIMI, [*NO_VLLM, f"cluster.log_dir={tmp_path / 'slurm'}", f"train.output_dir={tmp_path / 'train'}",
                                "sweep={train.lr: [1e-4, 3e-4]}", "tracking.allow_file_store=true", *extra])[1]


def test_two_submits_in_one_second_get_two_pipelines(tmp_path):
    a, b = _plan(tmp_path), _plan(tmp_path)
    assert a.id != b.id and a.root != b.root
    assert a.variant_files[0] != b.variant_files[0]


def test_pipeline_directories_and_variant_files_are_private(tmp_path):
    p = _plan(tmp_path)
    assert stat.S_IMODE(p.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "train" / p.id).stat().st_mode) == 0o700
    for f in p.variant_files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        check_variant_file(f)  # untouched: fine


def test_a_job_refuses_a_variant_file_edited_after_submit(tmp_path):
    from hpc.launch.stage_table import run_stage

    p = _plan(tmp_path)
    f = p.variant_files[1]
    f.write_text(f.read_text().replace("lr: 0.0003", "lr: 0.3"))
    with pytest.raises(UserError, match="changed after it was submitted"):
        check_variant_file(f)
    with pytest.raises(UserError, match="changed after it was submitted"):
        run_stage("report", str(f))  # before it reads a single key


@pytest.mark.parametrize("sweep, needle", [
    # variant 1 would get eval-n3/eval-n7 jobs, never n=5
    ("{eval.num_speculative_tokens: [[3, 7], [5]]}", "changes the pipeline's jobs (regenerate, train, calibrate, "
                                                     "eval-n3, eval-n7, report -> regenerate, train, calibrate, eval-n5"),
    # one regenerate job, at variant 0's temperature, would feed both
    ("{data.regen_temperature: [0.0, 0.7]}", "sweep.data.regen_temperature: the regenerate stage runs once"),
    ("{verifier.dtype: [bfloat16, float32]}", "sweep.verifier.dtype: the regenerate stage runs once"),
])
def test_a_sweep_over_what_the_array_shares_is_refused_before_any_file(tmp_path, sweep, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        plan_pipeline(KIMI, [*NO_VLLM, f"cluster.log_dir={tmp_path / 'slurm'}", f"train.output_dir={tmp_path / 'train'}",
                             f"sweep={sweep}", "tracking.allow_file_store=true"])
    assert not any((tmp_path / "slurm" / "pipelines").iterdir())  # nothing written, no empty pipeline


def test_the_report_job_runs_on_a_node_without_gpus(tmp_path, monkeypatch):
    """The report job asks Slurm for no GPU, yet resolving the Kimi config checked train.device=cuda
    on it: it failed before starting, and the pipeline's parent run stayed RUNNING."""
    import dataclasses

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU node, wherever this runs

    from hpc.config import ConfigError
    from hpc.launch import stage_table

    f = str(_plan(tmp_path).variant_files[0])
    seen = []
    real = stage_table.stage
    monkeypatch.setattr(stage_table, "stage", lambda name: dataclasses.replace(
        real(name), entry=lambda cfg, *a: seen.append((name, cfg.train.device)) or 0))
    assert stage_table.run_in_job("report", f) == 0 and seen == [("report", "cuda")]
    with pytest.raises(ConfigError, match="no CUDA device"):  # a GPU stage still checks its node
        stage_table.run_in_job("eval", f)


@pytest.mark.parametrize("fails_at", ["slurm", "mlflow"])
def test_a_submit_refused_before_any_job_leaves_no_pipeline_behind(tmp_path, monkeypatch, fails_at):
    """Slurm refusing the requests, or the tracking server the parent run: nothing was submitted,
    yet the pipeline's directory (0600 variant files, which may hold secrets) and an empty output
    directory stayed, and `dspark status` found a pipeline that never ran."""
    import hpc.launch.submit as submit_mod
    from hpc.launch.submit import submit

    monkeypatch.setattr(submit_mod, "requests_for", lambda cfg: [])
    monkeypatch.setattr(submit_mod, "check_requests", lambda reqs: ["cluster.partition = 'gpu': no such partition"]
                        if fails_at == "slurm" else [])
    if fails_at == "mlflow":
        def unreachable(*a, **k):
            raise ConnectionError("tracking server down")

        monkeypatch.setattr(submit_mod, "create_pipeline_run", unreachable)
    with pytest.raises((UserError, ConnectionError)):
        submit(KIMI, [*NO_VLLM, f"cluster.log_dir={tmp_path / 'slurm'}", f"train.output_dir={tmp_path / 'train'}",
                      f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", "tracking.allow_file_store=true"])
    assert list((tmp_path / "slurm" / "pipelines").iterdir()) == []
    assert list((tmp_path / "train").iterdir()) == []
