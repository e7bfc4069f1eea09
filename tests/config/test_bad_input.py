"""Bad input a new user types: each case fails at `validate`, in one line naming the key, and
nothing downstream ever sees it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc.config import ConfigError
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"


def problems_for(overrides: list[str], path: Path = KIMI) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve_recipe(path, overrides)
    assert all("\n" not in p for p in info.value.problems)  # one line each, even for a value with newlines
    return info.value.problems


BAD = {
    # Strings that reach generated job scripts.
    "newline in name": (["name='x\nsrun rm -rf ~'"], "name"),
    "path in name": (["name=../../etc"], "name = '../../etc'"),
    "newline in qos": (["cluster.qos='high\n#SBATCH --qos=root'"], "cluster.qos"),
    "qos with a space": (["cluster.qos='a b'"], "not a Slurm name"),
    "account with shell": (["cluster.account='$(id)'"], "cluster.account"),
    "mem not a size": (["cluster.mem=lots"], "cluster.mem"),
    "sbatch_extra with shell": (["cluster.sbatch_extra=['--constraint=h200; rm -rf /']"], "cluster.sbatch_extra[0]"),
    "sbatch_extra short flag": (["cluster.sbatch_extra=['-x']"], "cluster.sbatch_extra[0]"),
    "sbatch_extra owns --exclusive": (["cluster.sbatch_extra=['--exclusive']"], "set cluster.exclusive instead"),
    "sbatch_extra owns --mem": (["cluster.sbatch_extra=['--mem=200G']"], "set cluster.mem instead"),
    "mem-per-gpu beside --mem": (["cluster.sbatch_extra=['--mem-per-gpu=80G']"], "set cluster.mem=null too"),
    "newline in cron": (["schedule.cron='0 3 * * *\n* * * * * curl evil'"], "schedule.cron"),
    "tab in a data path": (["data.sources=[{path: \"a\tb\"}]"], "control character"),
    "space in log dir": (["cluster.log_dir='/shared/my runs'"], "cluster.log_dir"),
    "slurm pattern in log dir": (["cluster.log_dir=/shared/%u/logs"], "% patterns"),
    "slash in compare name": (["eval.compare=[{name: a/b, method: ngram}]"], "eval.compare[0].name"),
    "tracking uri without host": (["tracking.uri=http:/localhost:5000"], "no host"),
    "tracking uri typo in an absolute path": (["tracking.uri=sqlite:////nonexistent-dir/mlflow.db"],
                                              "directory of this store does not exist"),
    "tracking uri typo in a relative path": (["tracking.uri=sqlite:///nosuchdir/m.db"],
                                             "directory of this store does not exist"),
    "tracking uri typo in a relative file store": (["tracking.uri=file:nosuchdir/mlruns"],
                                                   "directory of this store does not exist"),
    "tracking uri unknown scheme": (["tracking.uri=sqlte:///runs/m.db"], "use http://HOST:PORT"),
    # An unset variable beside another problem: the interpolation raised past the problem list.
    "unset env var with a typo": (["train.output_dir=${oc.env:DSPARK_TEST_UNSET}/t", "train.lrr=1"],
                                  "DSPARK_TEST_UNSET"),
    # MLflow's filter strings quote the name: a quote in it breaks every registry search, in a job.
    "quote in registered model": (["tracking.registered_model=\"kimi's draft\""], "tracking.registered_model"),
    "empty registered model": (["tracking.registered_model=''"], "tracking.registered_model"),
    "public verifier host": (["verifier.host=0.0.0.0"], "verifier.allow_remote_host"),
    # Numbers that pass range checks and fail later.
    "nan lr": (["train.lr=.nan"], "train.lr = nan: must be a finite number"),
    "infinite loss weight": (["train.loss.tv_weight=.inf"], "train.loss.tv_weight"),
    "nan heartbeat": (["stream.heartbeat_s=.nan"], "stream.heartbeat_s"),
    "absurd step count": (["train.steps=1000000000000"], "implausibly large"),
    "absurd node count": (["cluster.trainer_nodes=100000"], "cluster.trainer_nodes"),
    "zero prefetch": (["stream.prefetch=0"], "stream.prefetch"),
    "zero gpu tflops": (["plan.gpu_tflops=0"], "plan.gpu_tflops"),
    "mfu over one": (["plan.mfu=2"], "plan.mfu"),
    # Repeats where each value names a job.
    "repeated n": (["eval.num_speculative_tokens=[3,3]"], "appears twice"),
    "repeated benchmark": (["eval.benchmarks=[gsm8k,gsm8k]"], "eval.benchmarks"),
    # Sweeps.
    "sweep over allocation": (["sweep={cluster.trainer_nodes: [1, 2]}"], "share one allocation"),
    "repeated sweep value": (["sweep={train.lr: [1e-4, 1e-4]}"], "sweep.train.lr = [0.0001, 0.0001]: 0.0001 appears twice"),
    "repeated sweep value, other spelling": (["sweep={train.lr: [1e-4, 0.0001]}"], "appears twice"),
    "sweep value out of range": (["sweep={train.lr: [1e-4, -1]}"], "sweep variant 1 (train.lr=-1): train.lr"),
    # Paths taken for hub ids.
    "relative data file": (["data.sources=[{path: data/missing.jsonl}]"], "data file does not exist"),
    "relative model dir": (["verifier.model=models/a/b"], "target model directory does not exist"),
    # Combinations a late stage would reject.
    "dflash layout with anchor": (["draft.markov_rank=0", "draft.enable_confidence_head=false",
                                   "draft.sample_from_anchor=true"], "draft.sample_from_anchor"),
    # OmegaConf's own words never reach the user.
    "string for int": (["train.steps=abc"], "train.steps = 'abc': must be an integer"),
    "hold out every row": (["train.hold_out_every=1"], "train.hold_out_every = 1: would hold out every row"),
    "negative hold out": (["train.hold_out_every=-5"], "train.hold_out_every = -5"),
    "word for enum": (["train.schedule=cosin"], "must be one of cosine, linear, constant"),
    "scalar for list": (["verifier.aux_layer_ids=3"], "must be a list"),
    "draft target dim": (["draft.target_vocab_size=77"], "draft.target_vocab_size = 77: is the target's: leave it out"),
    # A bad item is named by its own key, not blamed on the list it is in.
    "typo inside a source": (["data.sources=[{path: org/data, max_row: 100}]"],
                             "data.sources[0].max_row: unknown key; did you mean `data.sources[0].max_rows`?"),
    "word in a list of ints": (["eval.num_speculative_tokens=[3, x]"],
                               "eval.num_speculative_tokens[1] = 'x': must be an integer"),
    "typo inside a compare draft": (["eval.compare=[{name: a, metod: ngram}]"], "eval.compare[0].metod: unknown key"),
    "scalar for a source": (["data.sources=[3]"], "data.sources[0] = 3: must be a mapping"),
    "scalar sweep values": (["sweep={train.lr: 1}"], "sweep.train.lr = 1: must be a list"),
    # Values only a job would trip over.
    "source reading no row": (["data.sources=[{path: org/data, max_rows: 0}]"],
                              "data.sources[0].max_rows = 0: reads no row"),
    "calibration source reading no row": (["data.calibration_sources=[{path: org/cal, max_rows: -1}]"],
                                          "data.calibration_sources[0].max_rows = -1: reads no row"),
    "dtype vLLM does not take": (["verifier.dtype=float33"], "verifier.dtype = 'float33'"),
    "eval device": (["eval.device=gpu"], "eval.device = 'gpu': must be cpu, cuda, cuda:N, mps or xpu"),
    "a draft named as a compared one": (["eval.label=ngram", "eval.compare=[{name: ngram, method: ngram}]"],
                                        "eval.label = 'ngram': the draft's column on the card"),
    "a draft named baseline": (["eval.label=Baseline"], "eval.label = 'Baseline'"),
    "an empty draft name": (["eval.label=' '"], "eval.label = ' '"),
}


@pytest.mark.parametrize("overrides,needle", list(BAD.values()), ids=list(BAD))
def test_bad_value_is_refused_naming_the_key(overrides, needle):
    problems = problems_for(overrides)
    assert any(needle in p for p in problems), problems
    assert not any("could not be converted" in p or "full_key" in p for p in problems), problems


def test_an_old_yaml_with_removed_keys_is_told_they_were_removed(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(KIMI.read_text().replace("  sources:\n    - path: mlabonne/open-perfectblend\n",
                                            "  sources:\n    - path: mlabonne/open-perfectblend\n"
                                            "      format: conversations\n")
                   + "stream:\n  port: 0\n")
    problems = problems_for(["eval.concurrency=1"], old)
    removed = [p.split(":")[0] for p in problems if "removed, nothing read it" in p]
    assert removed == ["data.sources[0].format", "stream.port", "eval.concurrency"], problems
    assert len(problems) == 3, problems  # the other keys of the source still apply


def test_a_good_sweep_over_training_keys_passes():
    cfg = resolve_recipe(KIMI, ["sweep={train.lr: [1e-4, 3e-4]}"])
    assert cfg.sweep == {"train.lr": [1e-4, 3e-4]}


def test_a_sweep_over_the_cap_is_one_line_counted_not_expanded(monkeypatch):
    import hpc.config as config

    def expanded(*_args, **_kwargs):
        raise AssertionError("a sweep over the cap was expanded variant by variant")

    monkeypatch.setattr(config, "_variant_problems", expanded)
    values = "[" + ", ".join(str(i) for i in range(1, 9)) + "]"
    sweep = f"sweep={{train.lr: {values}, train.warmup_steps: {values}, train.max_anchors: {values}}}"
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [sweep])
    assert err.value.problems == ["sweep: 8 x 8 x 8 = 512 variants, over submit.max_variants = 256; sweep fewer "
                                  "values, or raise submit.max_variants if 512 trainings are meant"]
    monkeypatch.undo()
    cfg = resolve_recipe(KIMI, ["sweep={train.lr: [1e-4, 3e-4], train.seed: [0, 1]}", "submit.max_variants=4"])
    assert cfg.submit.max_variants == 4
    with pytest.raises(ConfigError, match="4 variants, over submit.max_variants = 3"):
        resolve_recipe(KIMI, ["sweep={train.lr: [1e-4, 3e-4], train.seed: [0, 1]}", "submit.max_variants=3"])
    with pytest.raises(ConfigError, match="submit.max_variants = 0: must be at least 1"):
        resolve_recipe(KIMI, ["submit.max_variants=0"])


def test_a_tracking_store_beside_the_pipelines_own_output_passes(tmp_path, monkeypatch):
    """The default sqlite:///runs/mlflow.db in a fresh checkout: runs/ does not exist yet, but
    the pipeline writes runs/train there anyway, so it is not a typo."""
    monkeypatch.chdir(tmp_path)
    for uri in ("sqlite:///runs/mlflow.db", f"sqlite:///{tmp_path}/runs/mlflow.db", "sqlite:///mlflow.db"):
        resolve_recipe(KIMI, [f"tracking.uri={uri}"])
    assert not (tmp_path / "runs").exists()


def test_ranks_per_node_null_resolves_to_one_number_everywhere():
    from hpc.launch.stages import node_ranks

    cfg = resolve_recipe(KIMI, ["cluster.trainer_nodes=2", "train.ranks_per_node=null", "train.global_batch_size=32"])
    assert cfg.train.ranks_per_node == 8  # null in the recipe: one rank per GPU
    assert node_ranks(cfg, 2) == (list(range(8, 16)), 16, 1)
    cfg.train.ranks_per_node = None  # a config object built without resolve() still works
    assert node_ranks(cfg, 0) == ([16], 16, 1)


FILES = {
    "empty": (b"", "is empty"),
    "only comments": (b"# nothing here\n\n", "is empty"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary file"),
    "not utf-8": (b"name: caf\xe9\n", "not UTF-8"),
    "section twice": (b"train:\n  lr: 1.0e-4\neval:\n  rows: 2\ntrain:\n  steps: 5\n", "`train` is given twice"),
    "key twice": (b"train:\n  lr: 1.0e-4\n  lr: 3.0e-4\n", "`lr` is given twice (lines 2 and 3)"),
    "a list, not a mapping": (b"- a\n- b\n", "top level must be a mapping"),
    "a number as a key": (b"train:\n  1: 5\n", "line 2 is not valid YAML (key 1 is not a name"),
    "a list as a key": (b"? [a, b]\n: 3\n", "key ['a', 'b'] is not a name"),
    "a boolean as a key": (b"train:\n  lr: 1.0e-4\n  on: 3\n", "key True is not a name"),
}


@pytest.mark.parametrize("content,needle", list(FILES.values()), ids=list(FILES))
def test_a_config_file_that_is_not_a_config_gives_one_line(tmp_path, content, needle):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    res = subprocess.run([sys.executable, "-m", "hpc", "validate", str(path), "--offline"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


TARGET_CONFIGS = {
    "truncated": (b'{"num_hidden_layers": 4, "hid', "is not valid JSON (truncated?)"),
    "empty": (b"", "is not valid JSON (truncated?)"),
    "a list": (b"[1, 2]", "holds a JSON list, not an object"),
}


@pytest.mark.parametrize("content,needle", list(TARGET_CONFIGS.values()), ids=list(TARGET_CONFIGS))
def test_a_broken_target_config_json_gives_one_line_naming_verifier_model(tmp_path, content, needle):
    (tmp_path / "config.json").write_bytes(content)
    res = subprocess.run([sys.executable, "-m", "hpc", "validate", str(KIMI), "--offline", f"verifier.model={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = next(x for x in res.stderr.splitlines() if "verifier.model" in x)
    assert needle in line and str(tmp_path / "config.json") in line, res.stderr


def test_every_reader_of_the_target_config_names_verifier_model(tmp_path):
    from hpc.errors import UserError
    from hpc.verifier.target_files import architectures, text_config

    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_')
    for read in (text_config, architectures):
        with pytest.raises(UserError, match=r"verifier.model = .*not valid JSON \(truncated\?\)"):
            read(tmp_path)


def test_overrides_may_follow_flags():
    res = subprocess.run([sys.executable, "-m", "hpc", "validate", str(KIMI), "--offline", "train.lr=-1"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "train.lr = -1" in res.stderr, res.stderr
    stray = subprocess.run([sys.executable, "-m", "hpc", "validate", str(KIMI), "--offline", "oops"],
                           capture_output=True, text=True, cwd=ROOT)
    assert stray.returncode == 2 and "override `oops`: expected KEY=VALUE" in stray.stderr, stray.stderr


def test_a_sweep_reads_the_yaml_and_the_target_once(monkeypatch):
    """Each variant is the loaded config plus its dotlist: re-reading the YAML and the target's
    config.json per variant made a 9-variant validate take over a second."""
    import hpc.config.load as load
    import hpc.config.validate_target as validate_target

    calls = {"yaml": 0, "shape": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(load, "_read_yaml", counted("yaml", load._read_yaml))
    monkeypatch.setattr(validate_target, "target_shape", counted("shape", validate_target.target_shape))
    cfg = resolve_recipe(KIMI, ["sweep={train.lr: [1e-4, 2e-4, 3e-4], train.seed: [0, 1, 2]}"])
    assert cfg.sweep == {"train.lr": [1e-4, 2e-4, 3e-4], "train.seed": [0, 1, 2]}
    assert calls == {"yaml": 1, "shape": 1}


def test_a_sweep_over_the_targets_dims_checks_each_variant_against_its_own_target():
    problems = problems_for(["sweep={verifier.num_hidden_layers: [61, 20]}"])
    assert any(p.startswith("sweep variant 1 (verifier.num_hidden_layers=20): verifier.aux_layer_ids")
               and "outside 0..20" in p for p in problems), problems
    assert not any(p.startswith("sweep variant 0") for p in problems), problems


def test_the_vllm_interpreter_is_checked_wherever_vllm_runs():
    # An HF capture backend still needs vLLM for regeneration, the baseline and third-party drafts.
    hf = ["verifier.backend=hf", "verifier.python=/nonexistent/bin/python"]
    assert any("vLLM runs from it (data.regenerate=true)" in p for p in problems_for(hf))
    assert any("vLLM runs from it (eval.compare)" in p
               for p in problems_for([*hf, "data.regenerate=false", "eval.engine=reference"]))
    resolve_recipe(KIMI, [*hf, "data.regenerate=false", "eval.engine=reference", "eval.compare=[]"])
