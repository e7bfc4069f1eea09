"""Login-node validation: every bad config is caught, named and explained, all at once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.config import ConfigError, config_hash, load_config, sweep_overrides, to_object
from hpc.config.validate import trainer_ranks
from tests.fixtures.recipes import NO_VLLM, resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"


def problems_for(overrides: list[str], path: Path = KIMI) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve_recipe(path, overrides)
    return info.value.problems


def test_kimi_recipe_is_valid_and_matches_the_card():
    cfg = resolve_recipe(KIMI)
    d, t, v = cfg.draft, cfg.train, cfg.verifier
    assert (d.draft_vocab_size, v.vocab_size, d.markov_rank, d.mask_token_id) == (32000, 163840, 256, 163608)
    assert v.aux_layer_ids == [1, 29, 57] and v.final_hidden.value == "post_norm"
    assert (cfg.data.max_seq_len, t.steps, t.lr, t.schedule.value, t.warmup_steps) == (20000, 20000, 3e-4, "cosine", 300)
    assert (t.global_batch_size, t.grad_accumulation, t.max_anchors) == (8, 2, 3072)
    assert (t.loss.ce_weight, t.loss.tv_weight, t.loss.decay_gamma) == (0.1, 0.9, 4.0)
    assert t.apply_verifier_norm is False
    assert cfg.eval.num_speculative_tokens == [3, 7]
    assert (v.tensor_parallel_size, v.max_model_len) == (8, 20480)
    assert v.compilation_config["pass_config"]["fuse_allreduce_rms"] is False
    assert d.num_attention_heads * d.head_dim == d.hidden_size == 7168
    # One value, owned by the draft: the data section reads it by interpolation.
    assert cfg.data.draft_vocab_size == d.draft_vocab_size


def test_dotlist_overrides_apply_with_types():
    cfg = resolve_recipe(KIMI, ["train.lr=1e-4", "verifier.aux_layer_ids=[2,30,58]", "cluster.account=abc"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.verifier.aux_layer_ids == [2, 30, 58]
    assert cfg.cluster.account == "abc"


def test_an_unquoted_slurm_time_is_a_time_not_a_base_60_number(tmp_path):
    """YAML 1.1 reads 1:00:00 as 3600, which Slurm reads as 3600 minutes (60 hours)."""
    from hpc.formats.slurm_time import parse_slurm_time

    text = KIMI.read_text().replace('time: "48:00:00"', "time: 2:00:00")
    assert "time: 2:00:00" in text
    (tmp_path / "c.yaml").write_text(text)
    assert resolve_recipe(tmp_path / "c.yaml").cluster.time == "2:00:00"
    cfg = resolve_recipe(KIMI, ["cluster.time=1:00:00"])
    assert cfg.cluster.time == "1:00:00" and parse_slurm_time(cfg.cluster.time) == 60
    assert resolve_recipe(KIMI, ["train.steps=1200", "train.lr=3e-4"]).train.steps == 1200  # numbers stay


def test_free_dicts_are_replaced_not_merged():
    cfg = resolve_recipe(KIMI, ["verifier.compilation_config={}", "verifier.env={A: '1'}"])
    assert cfg.verifier.compilation_config == {} and cfg.verifier.env == {"A": "1"}


def test_one_key_inside_a_free_dict_keeps_the_others():
    # Replacing the dict here dropped fuse_allreduce_rms: false, which breaks CUDA-graph capture.
    cfg = resolve_recipe(KIMI, ["verifier.compilation_config.level=3", "verifier.env.A=1"])
    assert cfg.verifier.compilation_config == {"pass_config": {"fuse_allreduce_rms": False}, "level": 3}
    cfg2 = resolve_recipe(KIMI, ["verifier.env={B: '2'}", "verifier.env.A=1"])
    assert cfg2.verifier.env == {"B": "2", "A": "1"}  # env values are strings
    # A dict written whole at a key inside one is replaced there, not merged into the old one.
    cfg3 = resolve_recipe(KIMI, ["verifier.compilation_config.pass_config={}"])
    assert cfg3.verifier.compilation_config == {"pass_config": {}}


def test_config_hash_follows_content_not_formatting():
    a = load_config(KIMI)
    b = load_config(KIMI, ["train.lr=0.0003"])
    c = load_config(KIMI, ["train.lr=1e-4"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


# Each case: overrides that break exactly one rule, and the key the message must name.
BAD_CASES = {
    "unknown top-level key": (["trian.lr=1"], "trian: unknown key; did you mean `train`"),
    "unknown nested key": (["train.learning_rate=1"], "train.learning_rate: unknown key"),
    "wrong type": (["train.steps=many"], "train.steps"),
    "bad enum": (["verifier.final_hidden=mid_norm"], "verifier.final_hidden"),
    "negative lr": (["train.lr=-0.1"], "train.lr"),
    "zero steps": (["train.steps=0"], "train.steps"),
    "warmup past steps": (["train.warmup_steps=30000"], "train.warmup_steps"),
    "aux id past the last layer": (["verifier.aux_layer_ids=[1,29,99]"], "verifier.aux_layer_ids"),
    "aux ids unsorted": (["verifier.aux_layer_ids=[29,1]"], "strictly increasing"),
    "no aux ids": (["verifier.aux_layer_ids=[]"], "verifier.aux_layer_ids"),
    "heads x head_dim != hidden": (["draft.num_attention_heads=64"], "draft.num_attention_heads"),
    "kv heads do not divide heads": (["draft.num_key_value_heads=5"], "draft.num_key_value_heads"),
    "block smaller than eval n": (["draft.block_size=4"], "draft.block_size"),
    # DFlash's layout spends slot 0 on the bonus token: its block of 8 drafts 7, as the eval job checks.
    "dflash block one short of eval n": (["draft.markov_rank=0", "draft.enable_confidence_head=false",
                                          "draft.sample_from_anchor=false", "draft.block_size=7",
                                          "eval.num_speculative_tokens=[3, 7]"],
                                         "draft.block_size = 7: holds at most 6 speculative tokens (slot 0"),
    # A DSpark draft without sample_from_anchor has the same bonus slot: it validated, then its
    # export refused n=8 after training had finished.
    "bonus-slot dspark block one short": (["draft.sample_from_anchor=false", "draft.block_size=7",
                                           "eval.num_speculative_tokens=[3, 7]"], "holds at most 6"),
    "mask id outside vocab": (["draft.mask_token_id=163840"], "draft.mask_token_id"),
    "draft vocab above target vocab": (["draft.draft_vocab_size=200000"], "draft.draft_vocab_size"),
    "pre-norm capture without norm": (["verifier.final_hidden=pre_norm"], "verifier.final_hidden"),
    "post-norm capture normed twice": (["train.apply_verifier_norm=true"], "double-normalises"),
    "missing model path": (["verifier.model=/nonexistent/kimi"], "verifier.model"),
    "missing data file": (["data.sources=[{path: ./no/such.jsonl}]"], "data.sources[0].path"),
    "missing calibration file": (["data.calibration_sources=[{path: ./no/cal.jsonl}]"],
                                 "data.calibration_sources[0].path"),
    "empty calibration path": (["data.calibration_sources=[{split: train}]"], "dspark calibration-set"),
    "no trainer nodes": (["cluster.trainer_nodes=0"], "cluster.trainer_nodes"),
    "empty capture dir": (["verifier.capture_dir="], "verifier.capture_dir = '': empty; name a directory"),
    "empty output dir": (["train.output_dir="], "train.output_dir = '': empty; name a directory"),
    "no verifier nodes": (["cluster.verifier_nodes=0"], "cluster.verifier_nodes"),
    "eval on several nodes": (["cluster.eval_nodes=4"], "cluster.eval_nodes = 4: an evaluation runs on one node"),
    "stream buffer below a micro-batch": (["train.global_batch_size=64", "stream.buffer_per_trainer=4"],
                                          "stream.buffer_per_trainer = 4: a micro-batch takes 8 samples"),
    "streamer beside vllm": (["verifier.gpu_memory_utilization=0.99"],
                             "verifier.gpu_memory_utilization = 0.99: leaves 1.4 GB of the verifier's last GPU"),
    "nccl timeout zero": (["stream.nccl_timeout_s=0"], "stream.nccl_timeout_s = 0.0: must be > 0"),
    "no samples in flight": (["stream.in_flight=0"], "stream.in_flight = 0: must be > 0"),
    # Credits cap what a streamer may have on the wire to its share of a trainer's buffer.
    "in flight beyond the receive share": (["cluster.verifier_nodes=2", "stream.buffer_per_trainer=8",
                                            "stream.in_flight=5"],
                                           "stream.in_flight = 5: exceeds a streamer's share of a trainer's receive "
                                           "buffer (4 = "),
    "nccl timeout above control": (["stream.nccl_timeout_s=9000", "verifier.health_timeout_s=1200"],
                                   "stream.nccl_timeout_s = 9000.0: exceeds the control plane's timeout (1800 s"),
    "batch not divisible": (["train.global_batch_size=10"], "train.global_batch_size"),
    "tp above gpus per node": (["verifier.tensor_parallel_size=16"], "verifier.tensor_parallel_size"),
    "nccl on cpu": (["train.device=cpu"], "train.dist_backend"),
    "cuda here without cuda": (["cluster.executor=local"], "train.device = 'cuda': this machine has no CUDA device"),
    "bad capture concurrency": (["verifier.capture_concurrency=0"], "verifier.capture_concurrency"),
    "fp16 without loss scaling": (["train.dtype=float16"], "float16 needs loss scaling"),
    "more nccl ranks than gpus": (["train.ranks_per_node=16"], "NCCL needs one GPU per rank"),
    "unknown benchmark": (["eval.benchmarks=[gsm8k,mmlu]"], "eval.benchmarks"),
    "zero n": (["eval.num_speculative_tokens=[0,3]"], "eval.num_speculative_tokens"),
    "dataset override for an unknown benchmark": (["eval.datasets={mmlu: /tmp}"], "eval.datasets.mmlu"),
    "missing dataset override file": (["eval.datasets={gsm8k: /nonexistent/gsm8k.jsonl}"], "eval.datasets.gsm8k"),
    "draft token cost out of range": (["eval.draft_token_cost=1.5"], "eval.draft_token_cost"),
    "adaptive without a confidence head": (["eval.adaptive=true", "draft.enable_confidence_head=false",
                                            "draft.confidence_head_with_markov=false"],
                                           "eval.adaptive = True: adaptive verification ranks drafts by the confidence"),
    "adaptive at zero requests": (["eval.adaptive_concurrency=[0, 8]"], "eval.adaptive_concurrency = 0"),
    "adaptive cost curve alone": (["eval.adaptive_cost.verify_ms=[[1, 2.0]]"], "eval.adaptive_cost.draft_ms"),
    "adaptive cost point malformed": (["eval.adaptive_cost.verify_ms=[[1.5, 2.0]]", "eval.adaptive_cost.draft_ms=[[1, 1]]"],
                                      "eval.adaptive_cost.verify_ms = [1.5, 2.0]: each point is [size, ms]"),
    "adaptive cost sizes out of order": (["eval.adaptive_cost.verify_ms=[[8, 2.0], [4, 3.0]]",
                                          "eval.adaptive_cost.draft_ms=[[1, 1]]"], "sizes must increase"),
    "bad slurm time": (["cluster.time=two days"], "cluster.time"),
    "bad tracking uri": (["tracking.uri=mlflow-server:5000"], "tracking.uri"),
    "bad cron": (["schedule.cron=every sunday"], "schedule.cron"),
    "cron that never fires": (["schedule.cron=0 3 31 4 *"], "schedule.cron = '0 3 31 4 *': never fires"),
    "no gpus for cuda and nccl": (["cluster.gpus_per_node=0"], "cluster.gpus_per_node = 0: train.device=cuda"),
    "no gpus to estimate prefill from": (["cluster.gpus_per_node=0", "train.device=cpu", "train.dist_backend=gloo"],
                                         "plan.prefill_tok_s_per_node = None: estimated from cluster.gpus_per_node"),
    "sweep over a non-key": (["sweep={train.lrate: [1e-4]}"], "sweep.train.lrate: not a config key"),
    "sweep value of wrong type": (["sweep={train.steps: [abc]}"], "train.steps"),
    "confidence with markov but no markov": (["draft.markov_rank=0"], "draft.confidence_head_with_markov"),
    "missing vllm interpreter": (["verifier.python=/nope/bin/python"], "verifier.python"),
    "seq len over model len": (["data.max_seq_len=40000"], "data.max_seq_len"),
    # A row of exactly max_model_len tokens validated, then every such row failed its capture.
    "seq len equal to model len": (["data.max_seq_len=20480"], "must be below verifier.max_model_len"),
    "malformed override": (["train.lr"], "expected KEY=VALUE"),
    "draft hidden differs from target": (["draft.hidden_size=4096", "draft.num_attention_heads=32"],
                                         "draft.hidden_size"),
}


@pytest.mark.parametrize("overrides,needle", list(BAD_CASES.values()), ids=list(BAD_CASES))
def test_bad_config_is_rejected_with_the_key_named(overrides, needle):
    problems = problems_for(overrides)
    assert any(needle in p for p in problems), problems
    # One line per problem, each naming what to do or what is allowed.
    assert all("\n" not in p for p in problems)


def test_a_calibration_set_of_prompts_needs_regeneration(tmp_path):
    prompts = tmp_path / "cal.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "2 + 2?"}]}) + "\n")
    answered = tmp_path / "answered.jsonl"
    answered.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2?"},
                                                 {"role": "assistant", "content": "4"}]}) + "\n")
    got = problems_for([f"data.calibration_sources=[{{path: {prompts}}}, {{path: {answered}}}]", "data.regenerate=false"])
    assert [p for p in got if "calibration_sources" in p] == [
        f"data.calibration_sources[0].path = '{prompts}': its rows have no assistant turn (prompts, as "
        "`dspark calibration-set` writes); set data.regenerate=true so the target answers them"]
    resolve_recipe(KIMI, [f"data.calibration_sources=[{{path: {prompts}}}]"])  # regenerated: fine


def test_a_gpu_config_is_fine_on_a_login_node_without_cuda():
    # Submitted to Slurm, the GPU is on the compute node: the login node's lack of one is no problem.
    import torch

    assert not torch.cuda.is_available()
    cfg = resolve_recipe(KIMI)
    assert cfg.train.device == "cuda" and cfg.cluster.executor == "slurm"
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_recipe(KIMI, runs_here=True)  # what a job's own node checks


def test_all_problems_are_reported_at_once():
    problems = problems_for(["train.lr=-1", "draft.block_size=2", "nosuch.key=1", "train.steps=abc"])
    keys = ["train.lr", "draft.block_size", "nosuch", "train.steps"]
    assert all(any(k in p for p in problems) for k in keys), problems


def test_target_config_json_is_the_source_of_truth(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 1000}))
    problems = problems_for([f"verifier.model={target}"])
    text = "\n".join(problems)
    # aux id 29 does not exist in a 4-layer target, and the configured dims disagree.
    assert "id 29 outside 0..4" in text
    assert "verifier.hidden_size" in text and "config.json says 64" in text
    assert "draft.mask_token_id" in text  # 163608 is outside a 1000-token vocab


def test_trainer_ranks_and_sweep_expansion():
    cfg = load_config(KIMI, ["sweep={train.lr: [3e-4, 1e-4], train.warmup_steps: [100]}"])
    variants = sweep_overrides(cfg)
    # each names its column on the card by what it sweeps
    assert variants == [["train.lr=0.0003", "train.warmup_steps=100", 'eval.label="lr=0.0003,warmup_steps=100"'],
                        ["train.lr=0.0001", "train.warmup_steps=100", 'eval.label="lr=0.0001,warmup_steps=100"']]
    for v in variants:
        resolve_recipe(KIMI, v)
    assert trainer_ranks(to_object(cfg)) == 4


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_validate_exit_codes_and_no_traceback():
    ok = run_cli("validate", str(KIMI), "--offline", *NO_VLLM)
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("validate", str(KIMI), "train.lr=-1", "draft.block_size=2", "--offline", *NO_VLLM)
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "Traceback" not in bad.stderr


@pytest.mark.parametrize("args,needle", [
    (["validate", "/no/such/config.yaml"], "config file not found"),
    (["validate", str(KIMI), "train..lr=1"], "unknown key"),
    (["validate", str(KIMI), "tracking.uri=http://127.0.0.1:9"], "MLflow server unreachable"),
    # After a flag, a word without `=` is still a bad override, not an unknown argument.
    (["validate", str(KIMI), "--offline", "train.lr=1e-4", "train.steps"], "override `train.steps`: expected KEY=VALUE"),
])
def test_cli_user_errors_are_one_line(args, needle):
    res = run_cli(*args)
    assert res.returncode != 0
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_invalid_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: [1,\n")
    res = run_cli("validate", str(bad))
    assert res.returncode == 2 and "not valid YAML" in res.stderr and "Traceback" not in res.stderr


def test_the_tracking_check_is_one_authenticated_api_call(monkeypatch):
    """urllib read `alice:s3cret@127.0.0.1` as the host name: validate called every server with a
    password in its URI unreachable, so `dspark submit` refused it. And it asked /health, which
    MLflow exempts from auth and from its Host check: a server that refused every job's API call
    read "valid". Now one API call, as the jobs make it, with the URI's or MLflow's credentials."""
    import base64
    import http.server
    import threading

    from hpc.config.validate_ops import _tracking_problem

    seen: list = []
    answers = {"ok": (200, b"{}"), "missing": (404, b'{"error_code": "RESOURCE_DOES_NOT_EXIST"}'),
               "noauth": (401, b"You are not authenticated."), "host": (403, b"Invalid Host header - possible DNS"),
               "denied": (403, b'{"error_code": "PERMISSION_DENIED"}'), "odd": (500, b"")}

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            code, body = answers[self.path.rsplit("=", 1)[1]]
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for var in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    try:
        uri = f"http://127.0.0.1:{srv.server_address[1]}"
        assert _tracking_problem(f"http://alice:s3%40cret@127.0.0.1:{srv.server_address[1]}/", "ok") is None
        assert _tracking_problem(uri, "missing") is None  # the first job makes the experiment
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
        assert _tracking_problem(uri, "ok") is None
        says = {name: _tracking_problem(uri, name) for name in ("noauth", "host", "denied", "odd")}
    finally:
        srv.shutdown()
        srv.server_close()
    basic = "Basic " + base64.b64encode(b"alice:s3@cret").decode()
    api = "/api/2.0/mlflow/experiments/get-by-name?experiment_name="
    bob = "Basic " + base64.b64encode(b"bob:pw").decode()
    assert seen[:3] == [(api + "ok", basic), (api + "missing", None), (api + "ok", bob)]
    assert "credentials.env" in says["noauth"] and "(401)" in says["noauth"]
    assert "refuses the host name '127.0.0.1'" in says["host"] and "--allow-host 127.0.0.1" in says["host"]
    assert "(403)" in says["denied"] and "READ" in says["denied"]
    assert "HTTP 500" in says["odd"]
    assert all("\n" not in line for line in says.values())


def test_a_path_with_a_hash_survives_an_override():
    """` #` opened a YAML comment: the generated output_dir overrides of `dspark submit` cut a user's
    `runs/exp #2` to `runs/exp`, and every sweep variant wrote into the one directory."""
    cfg = resolve_recipe(KIMI, ["train.output_dir=runs/exp #2/v0/train", "eval.output_dir='runs/q #1'"])
    assert cfg.train.output_dir == "runs/exp #2/v0/train" and cfg.eval.output_dir == "runs/q #1"


def test_yaml_11_octal_and_dotted_sweep_keys_read_as_written():
    """`0123` was the octal 83 (a Slurm account, an env value); `sweep.train.lr=[...]` nested a
    section under sweep instead of adding the key train.lr."""
    cfg = resolve_recipe(KIMI, ["cluster.account=0123", "verifier.env={B: 0777}", "train.steps=03000",
                                "sweep={draft.markov_rank: [4, 8]}", "sweep.train.lr=[1e-4, 3e-4]"])
    assert cfg.cluster.account == "0123" and cfg.verifier.env == {"B": "0777"} and cfg.train.steps == 3000
    assert cfg.sweep == {"draft.markov_rank": [4, 8], "train.lr": [1e-4, 3e-4]}


def test_an_override_through_a_list_index_sets_that_item_in_place():
    """`eval.compare.0.revision=SHA` pins the recipe's rival; the dotlist made {'0': {...}} of it,
    which replaced the list with a dict ("must be a list")."""
    cfg = load_config(KIMI, ["eval.compare.0.revision=" + "b" * 40, "data.sources.0.max_rows=5",
                             "eval.num_speculative_tokens.1=5"])
    [rival] = cfg.eval.compare
    assert (rival.name, rival.model, rival.revision) == ("eagle3", "lightseekorg/kimi-k2.6-eagle3-mla", "b" * 40)
    assert cfg.data.sources[0].max_rows == 5 and cfg.data.sources[0].path == "mlabonne/open-perfectblend"
    assert list(cfg.eval.num_speculative_tokens) == [3, 5]
    for override, says in (("eval.compare.1.revision=x", "eval.compare has 1 item(s), so index 1 is past its end"),
                           ("eval.compare.0.bogus=1", "eval.compare.0.bogus: unknown key"),
                           ("data.sources.0.max_rows=x", "data.sources.0.max_rows = 'x': must be an integer")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(KIMI, [override])


def test_directories_others_could_swap_are_refused_at_validate(tmp_path):
    """A capture_dir writable by all without the sticky bit, or another user's, read "valid" and was
    refused only when vLLM started on a compute node; a 0777 log_dir and an output_dir linked into
    another user's directory were not refused at all."""
    import os

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    (tmp_path / "linked").symlink_to(theirs)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [f"verifier.capture_dir={open_dir}", f"cluster.log_dir={open_dir}/slurm",
                              f"train.output_dir={tmp_path}/linked/train", f"data.output_dir={theirs}",
                              f"eval.output_dir={sticky}/eval"])
    lines = {line.split(" = ")[0]: line for line in err.value.problems}
    assert "writable by other users (mode 777) without the sticky bit" in lines["verifier.capture_dir"]
    assert "writable by other users" in lines["cluster.log_dir"]
    assert "belongs to uid 65534" in lines["train.output_dir"] and "belongs to uid 65534" in lines["data.output_dir"]
    assert "eval.output_dir" not in lines  # a shared directory with the sticky bit is safe
    assert all("use a directory of your own" in line for line in lines.values() if "output_dir" in line)
    assert sorted(p.name for p in open_dir.iterdir()) == []  # nothing made on the way


def test_a_dry_run_refused_for_its_directories_leaves_nothing(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    res = run_cli("submit", str(KIMI), *NO_VLLM, f"cluster.log_dir={open_dir}/slurm", "--dry-run")
    assert res.returncode == 2 and "cluster.log_dir" in res.stderr and "Traceback" not in res.stderr
    assert list(open_dir.iterdir()) == []  # no pipelines/ behind it
