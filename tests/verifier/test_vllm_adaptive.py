"""`validate` predicts vLLM's start-up refusal of adaptive verification (issue 45, item 4), read
from the GPU wheels' own Python files (0.33.0, the pin, and 0.34.0): no GPU, no vLLM import."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpc.verifier.vllm_adaptive import (
    GPUS,
    adaptive_problem,
    adaptive_verdict,
    attention_shape,
    compute_capability,
    source_version,
)
from hpc_dev.vllm_sources import VERSIONS
from tests.fixtures.infra import infra_unavailable

# The language model's config.json keys that decide the attention: Kimi-K2.6 (DeepSeek-V3's MLA,
# 64 heads) and two held-out targets: DeepSeek-V2-Lite (MLA, 16 heads) and a GQA model.
KIMI = {"num_attention_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 7168}
V2_LITE = {"num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 2048}
GQA = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096}


@pytest.fixture(scope="session", params=VERSIONS)
def vllm_src(request) -> Path:
    from hpc_dev.vllm_sources import VllmSourcesError, ensure_vllm_sources

    try:
        return ensure_vllm_sources(request.param)
    except VllmSourcesError as err:
        infra_unavailable(f"vLLM {request.param} sources unavailable: {err}")


@pytest.mark.parametrize("gpu", ["h100", "h200", "sm90", "9.0"])
@pytest.mark.parametrize("n", [3, 7])
def test_kimi_on_hopper_is_refused_in_one_line_naming_vllm_backend_gpu_and_fix(vllm_src, gpu, n):
    kind, line = adaptive_problem("/venv/bin/python", gpu, n, KIMI, [], root=vllm_src)
    assert kind == "error" and "\n" not in line
    version = source_version(vllm_src)
    assert version in VERSIONS and f"vLLM {version}" in line
    assert "FLASH_ATTN_MLA" in line and "UNIFORM_BATCH" in line
    assert "compute capability 9.0" in line
    assert f"1 to {n + 1} tokens per request that adaptive verification at n={n} needs" in line
    assert "eval.adaptive=false" in line


@pytest.mark.parametrize("config", [KIMI, V2_LITE])
@pytest.mark.parametrize("gpu", ["b200", "gb200"])
def test_mla_on_sm100_starts_with_flashinfer_mla(vllm_src, config, gpu):
    verdict = adaptive_verdict(vllm_src, compute_capability(gpu), 7, *attention_shape(config))
    assert (verdict.backend, verdict.support, verdict.refused) == ("FLASHINFER_MLA", "ALWAYS", False)
    assert adaptive_problem("/p", gpu, 7, config, [], root=vllm_src) is None


def test_a_forced_backend_is_the_one_judged(vllm_src):
    # Triton-MLA runs everywhere but replays no variable-length batch: refused even on a B200.
    kind, line = adaptive_problem("/p", "b200", 3, KIMI, ["--attention-backend", "TRITON_MLA"], root=vllm_src)
    assert kind == "error" and "TRITON_MLA" in line
    # FlashInfer-MLA forced on a Hopper is not adaptive's refusal but the backend's own: said, not guessed.
    kind, line = adaptive_problem("/p", "h200", 3, KIMI, ["--attention-backend=FLASHINFER_MLA"], root=vllm_src)
    assert kind == "warning" and "does not run on compute capability 9.0" in line


def test_what_the_source_decides_at_run_time_is_a_warning_not_a_guess(vllm_src):
    # GQA backends compute their capability check from the platform at run time.
    kind, line = adaptive_problem("/p", "h200", 3, GQA, [], root=vllm_src)
    assert kind == "warning" and "decides at start-up" in line
    kind, line = adaptive_problem("/p", "h200", 3, {}, [], root=vllm_src)  # no config.json on this machine
    assert kind == "warning" and "config.json is not on this machine" in line


def test_the_answer_is_read_from_the_source_not_remembered(vllm_src, tmp_path):
    # A vLLM whose FlashAttn-MLA builder replays any batch would start: the check follows the file.
    tree = tmp_path / "vllm"
    shutil.copytree(vllm_src, tree)
    path = tree / "v1" / "attention" / "backends" / "mla" / "flashattn_mla.py"
    text = path.read_text()
    head, sep, tail = text.partition("class FlashAttnMLAMetadataBuilder")
    assert sep and "AttentionCGSupport.UNIFORM_BATCH" in tail
    path.write_text(head + sep + tail.replace("AttentionCGSupport.UNIFORM_BATCH", "AttentionCGSupport.ALWAYS", 1))
    assert adaptive_problem("/p", "h200", 7, KIMI, [], root=tree) is None
    # And one whose Hopper list starts with Triton-MLA is judged by Triton-MLA.
    cuda = tree / "platforms" / "cuda.py"
    first = "            return [\n                AttentionBackendEnum.FLASH_ATTN_MLA,"
    cuda.write_text(cuda.read_text().replace(first, first.replace("FLASH_ATTN_MLA", "TRITON_MLA,\n" + " " * 16
                                                                  + "AttentionBackendEnum.FLASH_ATTN_MLA"), 1))
    kind, line = adaptive_problem("/p", "h200", 7, KIMI, [], root=tree)
    assert kind == "error" and "TRITON_MLA" in line


@pytest.mark.parametrize("text, cc", [("H200", (9, 0)), ("sm100", (10, 0)), ("10.3", (10, 3)), ("90", (9, 0)),
                                      ("sm_120", (12, 0)), ("a100", (8, 0))])
def test_gpu_names_and_capabilities(text, cc):
    assert compute_capability(text) == cc


@pytest.mark.parametrize("text", ["h300", "sm", "9.x", "", "1000", "9.10", "gpu"])
def test_an_unknown_gpu_is_refused_naming_the_accepted_forms(text):
    with pytest.raises(ValueError, match="h200") as err:
        compute_capability(text)
    assert "compute capability" in str(err.value) and all(name in str(err.value) for name in GPUS)


def test_validate_names_cluster_gpu_and_wires_the_check(monkeypatch, vllm_src):
    from hpc.config import ConfigError
    from hpc.config.checker import Checker
    from hpc.verifier import vllm_adaptive
    from tests.fixtures.recipes import resolve_recipe

    kimi = Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.6-dspark.yaml"
    with pytest.raises(ConfigError) as err:  # validate itself, on the login node
        resolve_recipe(kimi, ["cluster.account=a", "cluster.gpu=h300"])
    assert [p for p in err.value.problems if p.startswith("cluster.gpu")] == [
        p for p in err.value.problems if p.startswith("cluster.gpu = 'h300': not a GPU this check knows")]
    assert len([p for p in err.value.problems if p.startswith("cluster.gpu")]) == 1
    # The check validate runs (after the probe found a vLLM with adaptive verification at all).
    monkeypatch.setattr(vllm_adaptive, "vllm_source", lambda python: vllm_src)
    for gpu, refused in (("h200", True), ("b200", False)):
        cfg = resolve_recipe(kimi, ["cluster.account=a", f"cluster.gpu={gpu}", "eval.adaptive=true"])
        c = Checker()
        vllm_adaptive.check_adaptive_backend(c, cfg, "/venv/bin/python", KIMI)
        assert [p.split(":")[0] for p in c.problems] == (["eval.adaptive = True"] if refused else [])
