"""`dspark plan`: the capacity arithmetic on numbers small enough to check by hand."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from hpc.cli import main
from hpc.config.schema import DSparkConfig
from hpc.errors import UserError
from hpc.launch.plan import capacity_plan
from hpc.launch.plan_cli import format_plan
from hpc.verifier.gpu_budget import streamer_items
from tests.fixtures.recipes import NO_VLLM

ROOT = Path(__file__).resolve().parents[2]
KIMI = "configs/kimi-k2.6-dspark.yaml"


def tiny(**plan) -> DSparkConfig:
    """hidden 4, 3 aux layers, fp32 stream, 10-token samples, measured rates."""
    cfg = DSparkConfig(name="tiny")
    v, d, c, t = cfg.verifier, cfg.draft, cfg.cluster, cfg.train
    v.hidden_size, v.vocab_size, v.aux_layer_ids = 4, 64, [1, 2, 3]
    d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim = 8, 2, 1, 4
    d.intermediate_size, d.draft_vocab_size, d.mask_token_id, d.markov_rank = 16, 16, 3, 2
    cfg.data.max_seq_len = 20
    cfg.stream.dtype = "float32"
    c.gpus_per_node, c.verifier_nodes, c.trainer_nodes = 2, 1, 1
    t.ranks_per_node, t.global_batch_size, t.grad_accumulation, t.device, t.dtype = None, 4, 1, "cpu", "float32"
    p = cfg.plan
    p.avg_seq_len, p.prefill_tok_s_per_node, p.trainer_step_samples_s_per_gpu = 10, 100.0, 2.0
    p.link_gbps, p.gpu_memory_gb = 1.0, 1.0
    for key, value in plan.items():
        setattr(p, key, value)
    return cfg


def test_hand_computed_supply_demand_and_balance():
    pl = capacity_plan(tiny())
    assert pl.bytes_per_token == (3 + 1) * 4 * 4 + 16 == 80  # states + int64 id and mask
    assert pl.bytes_per_sample == 10 * 80 + 64 == 864  # + the int64[8] header
    assert pl.supply_samples_s == pytest.approx(100 / 10)
    assert pl.supply_bytes_s == pytest.approx(10 * 864)
    assert not pl.link_bound and pl.link_bytes_s == pytest.approx(1e9 / 8)
    assert pl.demand_samples_s == pytest.approx(2.0 * 2)  # 2 GPUs x 2 samples/s
    assert pl.trainer_nodes_per_verifier_node == pytest.approx(2.5)
    # 1:2 costs 3 nodes / 8 samples/s = 0.375, 1:3 costs 4 / 10 = 0.4 node-s per sample.
    assert (pl.recommend_verifier_nodes, pl.recommend_trainer_nodes) == (1, 2)
    assert pl.trainer_wait == 0.0 and pl.verifier_throttle == pytest.approx(0.6)

    three = tiny()
    three.cluster.trainer_nodes = 3
    pl3 = capacity_plan(three)
    assert pl3.cluster_demand_samples_s == pytest.approx(12.0)
    assert pl3.trainer_wait == pytest.approx(1 - 10 / 12) and pl3.verifier_throttle == 0.0


def test_slow_trainers_get_several_verifiers_each():
    pl = capacity_plan(tiny(trainer_step_samples_s_per_gpu=10.0))  # demand 20 vs supply 10
    assert pl.trainer_nodes_per_verifier_node == pytest.approx(0.5)
    assert (pl.recommend_verifier_nodes, pl.recommend_trainer_nodes) == (2, 1)
    assert pl.trainer_wait == pytest.approx(0.5)


def test_link_bound_supply_uses_the_link():
    pl = capacity_plan(tiny(link_gbps=1e-5))  # 1250 B/s on the wire
    assert pl.link_bytes_s == pytest.approx(1250)
    assert pl.link_bound
    assert pl.supply_samples_s == pytest.approx(1250 / 864)
    assert pl.supply_samples_s < pl.prefill_samples_s == pytest.approx(10.0)
    assert pl.demand_samples_s == pytest.approx(1250 / 864)  # a trainer's ingress is the same link
    assert "LINK-BOUND" in format_plan(pl)


def test_estimates_follow_the_flops_formulas():
    pl = capacity_plan(tiny(prefill_tok_s_per_node=None, trainer_step_samples_s_per_gpu=None,
                            target_params_b=2.0, target_active_params_b=1.0, gpu_tflops=1.0, mfu=0.5))
    assert pl.prefill_estimated and pl.trainer_estimated
    assert pl.prefill_tok_s == pytest.approx(2 * 1e12 * 0.5 / (2 * 1e9))  # 2 GPUs, 2 FLOPs per active param
    assert pl.trainer_samples_s_per_gpu == pytest.approx(1e12 * 0.5 / pl.train_flops_per_sample)


def test_the_verifier_runs_on_its_tensor_parallel_gpus_only():
    """One vLLM per node on tensor_parallel_size GPUs: prefill and the memory the target must fit
    in are those GPUs', not the node's (TP=2 of 8 H200s was said to fit Kimi's 600 GB)."""
    cfg = tiny(prefill_tok_s_per_node=None, gpu_tflops=1.0, mfu=0.5, target_active_params_b=1.0,
               target_params_b=2.0, target_bytes_per_param=1.0, gpu_memory_gb=1.0)
    cfg.cluster.gpus_per_node, cfg.verifier.gpu_memory_utilization = 8, 0.9
    cfg.verifier.tensor_parallel_size = 2
    pl = capacity_plan(cfg)
    assert pl.prefill_tok_s == pytest.approx(2 * 1e12 * 0.5 / (2 * 1e9))
    assert pl.verifier_node_bytes == pytest.approx(2 * 1e9)  # GB = 1e9 bytes
    assert pl.verifier_over and pl.kv_headroom_bytes == pytest.approx(0.9 * 2e9 - 2e9)  # 1.8 GB usable < 2 GB
    cfg.verifier.tensor_parallel_size = 4
    pl4 = capacity_plan(cfg)
    assert pl4.prefill_tok_s == pytest.approx(2 * pl.prefill_tok_s) and not pl4.verifier_over


def test_memory_over_budget_is_flagged():
    pl = capacity_plan(tiny(gpu_memory_gb=1e-6))
    assert pl.trainer_over and pl.trainer_gpu_bytes > pl.gpu_bytes
    assert any(line.lstrip().startswith("total") and "OVER" in line for line in format_plan(pl).splitlines())
    assert not capacity_plan(tiny()).trainer_over
    big = capacity_plan(tiny(target_params_b=1000.0, target_active_params_b=32.0, target_bytes_per_param=2.0))
    assert big.verifier_over and "OVER: the target does not fit" in format_plan(big)


@pytest.mark.parametrize("knob", ["link_gbps=0", "mfu=1.5", "prefill_tok_s_per_node=-1"])
def test_bad_knob_names_the_key(knob):
    key, value = knob.split("=")
    cfg = tiny(**{key: float(value)})
    with pytest.raises(UserError, match=rf"^plan\.{key} = "):
        capacity_plan(cfg)


def test_cli_prints_the_kimi_plan(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", KIMI, *NO_VLLM]) == 0
    out = capsys.readouterr().out
    for line in ("kimi-k2.6-dspark: capacity plan", "bytes per captured token", "57.36 KB", "573.60 MB",
                 "supply", "demand", "trainer nodes per verifier node", "1 verifier : 1 trainer",
                 "trainer data-wait", "memory per trainer GPU", "AdamW states", "stream buffer",
                 "block activations", "logits + loss", "streamer on the verifier's last GPU (beside vLLM)", "CUDA context",
                 "fits plan.gpu_memory_gb", "target weights", "600.00 GB"):
        assert line in out, line


def test_cli_bad_knob_exits_2_naming_the_key(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", KIMI, *NO_VLLM, "plan.link_gbps=0"]) == 2
    err = capsys.readouterr().err
    assert "plan.link_gbps" in err and len(err.strip().splitlines()) == 1


def test_the_stream_buffer_is_the_pools_bound_at_the_longest_sample():
    """Credit shares round up per streamer (8 over 3: 9), a step's micro-batches stay held while
    it packs, and any buffer may have grown to data.max_seq_len, not the average."""
    cfg = tiny()
    cfg.cluster.verifier_nodes, cfg.stream.buffer_per_trainer, cfg.train.grad_accumulation = 3, 8, 2
    cfg.train.global_batch_size = 8  # 2 ranks x 2 accumulation: micro-batches of 2
    item = next(m for m in capacity_plan(cfg).trainer_memory if m.what == "stream buffer")
    assert item.bytes == (9 + 2 * 2) * 20 * 80
    assert item.how.startswith("13 samples of data.max_seq_len")


def test_the_streamers_samples_on_the_wire_fill_vllms_headroom_and_no_more(monkeypatch):
    """stream.in_flight to each trainer, capped streamer-wide by what fits beside vLLM; the sender
    gets the same cap (hpc.verifier.gpu_budget.samples_in_flight), so plan and run agree."""
    from hpc.config.load import load_config
    from hpc.verifier.gpu_budget import headroom_bytes, largest_sample_bytes, samples_in_flight

    monkeypatch.chdir(ROOT)
    cfg = load_config(KIMI)
    sample = largest_sample_bytes(cfg)
    for in_flight, ranks in ((1, 1), (2, 2), (2, 64)):
        cfg.stream.in_flight = in_flight
        n = samples_in_flight(cfg, ranks)
        fixed = sum(b for what, b, _ in streamer_items(cfg, ranks) if what != "samples on the GPU")
        assert in_flight <= n <= in_flight * ranks
        assert n == in_flight * ranks or (n + 1) * sample > headroom_bytes(cfg) - fixed  # no room for one more
    cfg.stream.in_flight = 2
    pl = capacity_plan(cfg)
    assert pl.in_flight == 2 and pl.in_flight_total == samples_in_flight(cfg, pl.ranks_per_node * pl.trainer_nodes)
    gpu = next(m for m in pl.streamer_memory if m.what == "samples on the GPU")
    assert gpu.bytes == pl.in_flight_total * sample


# -- the pipeline's time (hpc.launch.plan_time) ---------------------------------------------------

def kimi(*overrides: str) -> DSparkConfig:
    from tests.fixtures.recipes import resolve_recipe

    return resolve_recipe(ROOT / KIMI, list(overrides))


def validate_errors(capsys, *overrides: str) -> list[str]:
    """`dspark validate` on the Kimi recipe: its error lines (none when it passes)."""
    code = main(["validate", str(ROOT / KIMI), "--offline", *NO_VLLM, *overrides])
    errors = [ln.removeprefix("error: ") for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert (code == 0) == (errors == []), errors
    return errors


def test_the_kimi_stages_follow_the_formulas():
    import yaml

    from hpc.launch.plan_time import REPORT_S

    cfg = kimi()
    pl = capacity_plan(cfg)
    pt = pl.pipeline
    assert pt is not None and pt.problems == []
    fs, decode, rows = 0.5, 110.0, cfg.data.sources[0].max_rows  # the modelled filesystem and decode rate
    load = 120 + 1000 * 0.6 / fs  # vLLM's start + Kimi's ~600 GB of weights read at the filesystem's rate
    # A checkpoint: every draft tensor in fp32 and AdamW's two moments, as the memory table counts them.
    mem = {m.what: m.bytes for m in pl.trainer_memory}
    ckpt = mem["draft params (fp32 master)"] + mem["frozen embedding + lm_head"] + mem["AdamW states (2x fp32)"]
    assert pt.checkpoint_bytes == pytest.approx(ckpt) and 25e9 < ckpt < 30e9
    write = ckpt / 1e9 / fs
    regen = load + rows * cfg.data.regen_max_tokens / (cfg.cluster.regenerate_nodes * cfg.data.regen_concurrency * decode)
    train = pl.run_hours * 3600 + math.ceil(cfg.train.steps / cfg.train.checkpoint_interval) * write + load
    held = rows // cfg.train.hold_out_every
    calibrate = load + held * pl.avg_seq_len / pl.prefill_tok_s + held / (3 * pl.trainer_samples_s_per_gpu)
    manifests = {b: yaml.safe_load((ROOT / "hpc/formats/manifests" / f"{b}.yaml").read_text()) for b in cfg.eval.benchmarks}
    tokens = sum((m["rows"] or m["expected_rows"]) * (cfg.eval.code_max_tokens if m["code"] else cfg.eval.max_tokens)
                 for m in manifests.values())
    runs = 1 + len(cfg.eval.compare) + 1  # our draft, eagle3 and the baseline (eval.timing=cached), a server each
    evaluation = runs * load + runs * tokens / decode
    want = {"regenerate": regen, "train": train, "calibrate": calibrate, "eval-n3": evaluation, "eval-n7": evaluation,
            "report": REPORT_S}
    got = {s.name: s.seconds for s in pt.stages}
    assert got == pytest.approx(want)
    from hpc.launch.plan_time import critical_path

    assert critical_path(pt) == pytest.approx(regen + train + calibrate + evaluation + REPORT_S)
    gpus = {"regenerate": 4 * 8, "train": 2 * 8, "calibrate": 8, "eval-n3": 8, "eval-n7": 8, "report": 0}
    assert {s.name: s.gpu_hours for s in pt.stages} == pytest.approx({k: gpus[k] * v / 3600 for k, v in want.items()})
    assert regen <= train < 48 * 3600  # the recipe regenerates in no longer than it trains; one allocation each
    step = cfg.train.global_batch_size / min(pl.cluster_supply_samples_s, pl.cluster_demand_samples_s)
    assert pt.window_s == pytest.approx(1.5 * (step + write + 10 + 25 + 10))
    assert 90 < pt.window_s <= cfg.cluster.signal_delay_s
    out = format_plan(pl)
    for line in ("pipeline time", "preemption window", "total", "eval-n7", "fits --time=", "modelled"):
        assert line in out, line


def test_the_stages_are_the_pipelines_jobs():
    from hpc.launch.stage_table import jobs

    for extra in ([], ["data.regenerate=false"], ["train.hold_out_every=0"], ["eval.adaptive=true"],
                  ["train.hold_out_every=0", "data.calibration_sources=[{path: org/cal, max_rows: 10}]"],
                  ["eval.num_speculative_tokens=[5]", "draft.enable_confidence_head=false"]):
        cfg = kimi(*extra)
        assert [s.name for s in capacity_plan(cfg).pipeline.stages] == [j.name for j in jobs(cfg)], extra


@pytest.mark.parametrize("key, value, row", [
    ("fs_gbytes_s", 0.78, "filesystem"), ("decode_tok_s_per_stream", 90, "decode per request"),
    ("regen_tok_s_per_server", 3000, "regeneration per server"), ("target_load_s", 900, "target load"),
    ("regen_tokens_per_row", 1500, "tokens per regenerated row"),
])
def test_a_set_key_is_measured_and_changes_the_estimate(key, value, row):
    def figure(pl):
        return next(how for what, _, how in pl.pipeline.inputs if what == row)

    base, cfg = capacity_plan(kimi()), kimi(f"plan.{key}={value}")
    measured = capacity_plan(cfg)
    assert figure(base).startswith("modelled") and figure(measured).startswith("measured"), figure(measured)
    assert f"plan.{key}" in figure(measured)
    assert [s.seconds for s in measured.pipeline.stages] != [s.seconds for s in base.pipeline.stages]


@pytest.mark.parametrize("key", ["fs_gbytes_s", "decode_tok_s_per_stream", "regen_tok_s_per_server",
                                 "regen_tokens_per_row", "target_load_s", "source_rows"])
def test_a_new_rate_at_or_below_zero_is_one_line(capsys, key):
    for value in ("0", "-1"):
        errors = validate_errors(capsys, f"plan.{key}={value}")
        assert len(errors) == 1 and errors[0].startswith(f"plan.{key} = "), errors


def test_too_few_rows_for_the_training_is_one_line(capsys):
    # 20000 steps x 8 = 160,000 samples, and 1 row in 1000 held out: 160,161 rows.
    errors = validate_errors(capsys, "data.sources.0.max_rows=160160")
    assert len(errors) == 1 and errors[0].startswith("data.sources[0].max_rows = 160160: below the 160,161 rows"), errors
    assert validate_errors(capsys, "data.sources.0.max_rows=160161") == []


def test_regenerating_an_unknown_row_count_is_one_line(capsys):
    errors = validate_errors(capsys, "data.sources.0.max_rows=null")
    assert len(errors) == 1 and errors[0].startswith("data.sources[0].max_rows = None: data.regenerate=true"), errors
    assert "plan.source_rows" in errors[0]
    assert validate_errors(capsys, "data.sources.0.max_rows=null", "plan.source_rows=170000") == []
    assert validate_errors(capsys, "data.sources.0.max_rows=null", "data.regenerate=false") == []
    pl = capacity_plan(kimi("data.sources.0.max_rows=null", "data.regenerate=false"))
    assert next(s for s in pl.pipeline.stages if s.name == "calibrate").seconds is None  # said, not refused


def test_a_regeneration_longer_than_cluster_time_is_refused_naming_the_stage(capsys):
    errors = validate_errors(capsys, "cluster.regenerate_nodes=1", "data.regen_concurrency=8")
    assert len(errors) == 1 and errors[0].startswith("cluster.time = '48:00:00': stage regenerate needs "), errors
    assert "cluster.regenerate_nodes" in errors[0] and "data.regen_concurrency" in errors[0]


def test_training_resumes_across_its_time_limit_and_other_stages_do_not():
    cfg = kimi("cluster.time=04:00:00")
    pt = capacity_plan(cfg).pipeline
    train = next(s for s in pt.stages if s.name == "train")
    load, limit = 120 + 600 / 0.5, 4 * 3600
    work = train.seconds - train.allocations * load - (train.allocations - 1) * pt.checkpoint_bytes / 1e9 / 0.5
    assert train.allocations == math.ceil(work / (limit - load - cfg.cluster.signal_delay_s)) > 1
    assert [re.search(r"stage (\S+) needs", p).group(1) for p in pt.problems] == ["regenerate"], pt.problems
    never = capacity_plan(kimi("cluster.time=00:20:00")).pipeline.problems
    assert any("stage train: an allocation ends before training starts" in p for p in never), never


def test_the_preemption_window_refuses_kimi_at_90_s(capsys):
    errors = validate_errors(capsys, "cluster.signal_delay_s=90")
    assert len(errors) == 1 and errors[0].startswith("cluster.signal_delay_s = 90: shorter than the "), errors
    for part in ("write the checkpoint", "streamer STOP", "vLLM shutdown", "requeue"):
        assert part in errors[0]
    need = capacity_plan(kimi()).pipeline.window_s
    assert f"cluster.signal_delay_s={math.ceil(need)} or more" in errors[0]
    assert validate_errors(capsys, f"cluster.signal_delay_s={math.ceil(need)}") == []
    assert validate_errors(capsys) == []  # the recipe's own delay


@pytest.mark.parametrize("overrides", [[], ["train.steps=8", "train.checkpoint_interval=4", "eval.rows=1",
                                            "eval.max_tokens=16", "cluster.regenerate_nodes=2", "eval.adaptive=true",
                                            "eval.adaptive_concurrency=[1,4]"]])
def test_the_toy_config_is_not_refused(overrides):
    from hpc.config.load import load_config, to_object

    cfg = to_object(load_config(ROOT / "configs" / "toy-cpu.yaml", overrides))  # the toy target need not exist
    pt = capacity_plan(cfg).pipeline
    assert pt.problems == [] and all(s.seconds is not None for s in pt.stages)


def test_submit_refuses_what_validate_refuses_and_leaves_nothing(tmp_path):
    from hpc.errors import ConfigError
    from hpc.launch.submit import plan_pipeline
    from tests.fixtures.recipes import KIMI, NO_VLLM

    logs = tmp_path / "logs"
    ov = [*NO_VLLM, "cluster.account=a", f"cluster.log_dir={logs}", f"train.output_dir={tmp_path / 'train'}",
          f"data.output_dir={tmp_path / 'data'}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
          "tracking.allow_file_store=true", "sweep={train.lr: [3e-4, 1e-4]}"]
    for bad, key in ((["cluster.signal_delay_s=90"], "cluster.signal_delay_s = 90"),
                     (["data.sources[0].max_rows=1000"], "data.sources")):
        with pytest.raises(ConfigError) as err:
            plan_pipeline(str(KIMI), [*ov, *bad])
        assert len(err.value.problems) == 1 and err.value.problems[0].startswith(key), err.value.problems
        assert not any((logs / "pipelines").iterdir()) if (logs / "pipelines").exists() else True
        assert not (tmp_path / "train").exists() or not any((tmp_path / "train").iterdir())


def test_the_streamers_time_slicing_is_assumed_until_measured_and_then_costs_prefill(capsys):
    assumed, measured = capacity_plan(kimi()), capacity_plan(kimi("plan.timeslice_slowdown=0.1"))
    assert assumed.timeslice_slowdown == 0 and not assumed.timeslice_measured
    assert "ASSUMED 0, not measured" in format_plan(assumed)
    assert measured.timeslice_measured and measured.prefill_tok_s == pytest.approx(0.9 * assumed.prefill_tok_s)
    assert "measured (plan.timeslice_slowdown)" in format_plan(measured)
    # A stream over gloo stages on the host: the GPU is vLLM's alone, and nothing is lost.
    apart = capacity_plan(kimi("train.dist_backend=gloo", "plan.timeslice_slowdown=0.1"))
    assert apart.timeslice_slowdown == 0 and not apart.streamer_memory
    for bad in ("1.0", "-0.1"):
        errors = validate_errors(capsys, f"plan.timeslice_slowdown={bad}")
        assert len(errors) == 1 and errors[0].startswith(f"plan.timeslice_slowdown = {float(bad)}"), errors


def test_the_plans_vllm_grace_is_the_one_the_servers_use():
    from hpc.launch.plan_time import VLLM_STOP_GRACE_S
    from hpc.proc import SubprocessServer

    assert VLLM_STOP_GRACE_S == SubprocessServer.stop_grace


def test_a_shared_verifier_prices_k_copies_on_its_link_and_the_gpu_hours_it_saves():
    cfg = tiny()
    cfg.sweep, cfg.submit.share_verifier = {"train.lr": [1e-3, 3e-4, 1e-4]}, True
    solo, pl = capacity_plan(tiny()), capacity_plan(cfg)
    sh = pl.shared
    assert sh is not None and sh.variants == 3 and pl.run_hours == solo.run_hours  # the solo figures stay
    assert sh.bytes_per_sample == 3 * 864 and sh.link_samples_s == pytest.approx(1e9 / 8 / (3 * 864))
    # Prefill-bound at 10 samples/s; each variant's one trainer node wants 4: supply outruns it.
    assert sh.supply_samples_s == pytest.approx(10.0) and not sh.link_bound
    assert sh.group_demand_samples_s == pytest.approx(4.0) and sh.nodes == 1 + 3 * 1
    assert sh.run_hours == pytest.approx(solo.run_hours)  # each variant trains as fast as alone
    assert sh.gpu_hours == pytest.approx(4 * 2 * sh.run_hours)  # 4 nodes x 2 GPUs
    assert sh.solo_gpu_hours == pytest.approx(3 * 2 * 2 * solo.run_hours)  # 3 allocations of 2 nodes
    assert sh.most_variants_link == int(1e9 / 8 / (864 * 4.0))
    text = format_plan(pl)
    assert "shared verifier (submit.share_verifier: 3 variants from one capture)" in text
    assert "33% saved" in text  # 4 nodes against 6
    assert capacity_plan(tiny()).shared is None and "shared verifier" not in format_plan(solo)


def test_a_link_that_cannot_carry_the_copies_is_one_line_naming_the_most_variants(monkeypatch):
    from hpc.config import ConfigError
    from tests.fixtures.recipes import resolve_recipe

    sweep = "sweep={train.lr: [3e-4, 1e-4, 5e-5, 3e-5]}"
    with pytest.raises(ConfigError) as err:  # 4 copies of a Kimi sample over 40 Gb/s
        resolve_recipe(KIMI, ["cluster.account=a", sweep, "submit.share_verifier=true", "plan.link_gbps=40"])
    (line,) = [p for p in err.value.problems if p.startswith("submit.share_verifier")]
    most = int(40e9 / 8 / (capacity_plan(resolve_recipe(KIMI, ["cluster.account=a"])).bytes_per_sample * 4.53))
    assert "4 variants" in line and f"feeds at most {most} variant(s)" in line, line
    assert resolve_recipe(KIMI, ["cluster.account=a", sweep, "submit.share_verifier=true"]).submit.share_verifier


def test_a_streamer_that_does_not_fit_beside_vllm_for_k_variants_names_the_most_that_do():
    from hpc.config import ConfigError
    from tests.fixtures.recipes import resolve_recipe

    base = ["cluster.account=a", "sweep={train.lr: [3e-4, 1e-4, 5e-5]}", "submit.share_verifier=true"]
    cfg = resolve_recipe(KIMI, ["cluster.account=a"])
    ranks = cfg.cluster.trainer_nodes * cfg.train.ranks_per_node

    from hpc.verifier import gpu_budget as g

    def least(k: int) -> float:  # the context, NCCL with a connection per trainer rank, a window of samples
        return (g.CUDA_CONTEXT_BYTES + g.NCCL_COMM_BYTES + ranks * k * g.NCCL_PEER_BYTES
                + cfg.stream.in_flight * g.largest_sample_bytes(cfg))
    util = 1 - (least(2) + least(3)) / 2 / (cfg.plan.gpu_memory_gb * 1e9)  # room for 2 variants, not 3
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [*base, f"verifier.gpu_memory_utilization={util:.6f}"])
    (line,) = [p for p in err.value.problems if p.startswith("submit.share_verifier")]
    assert "feeding 3 variants' trainers" in line and "at most 2 variants fit" in line, line


def test_the_readmes_shared_verifier_figures_are_the_plans():
    from tests.fixtures.recipes import resolve_recipe

    text = " ".join((ROOT / "README.md").read_text().split())
    got = re.search(r"it reads (\d+) nodes against 3 x (\d+), .*?up to (\d+) variants\), and (\d+) train GPU-hours "
                    r"against (\d+)", text)
    assert got, "README.md's shared-verifier paragraph changed shape"
    pl = capacity_plan(resolve_recipe(KIMI, ["cluster.account=a", "sweep={train.lr: [3e-4, 1e-4, 5e-5]}",
                                             "submit.share_verifier=true"]))
    sh = pl.shared
    assert sh is not None and not sh.link_bound and sh.run_hours == pytest.approx(sh.solo_run_hours)
    assert [int(x) for x in got.groups()] == [sh.nodes, pl.verifier_nodes + pl.trainer_nodes, sh.most_variants_link,
                                              round(sh.gpu_hours), round(sh.solo_gpu_hours)]


def test_the_ablations_are_priced_as_three_drafts_from_one_capture():
    from tests.fixtures.recipes import resolve_recipe

    ablations = capacity_plan(resolve_recipe(KIMI, ["cluster.account=a", "submit.ablations=true"]))
    sweep = capacity_plan(resolve_recipe(KIMI, ["cluster.account=a", "sweep={train.lr: [3e-4, 1e-4, 5e-5]}",
                                                "submit.share_verifier=true"]))
    a, s = ablations.shared, sweep.shared
    assert a is not None and s is not None and a.key == "submit.ablations" and a.variants == 3
    assert (a.nodes, a.bytes_per_sample, a.gpu_hours, a.solo_gpu_hours) == (
        s.nodes, s.bytes_per_sample, s.gpu_hours, s.solo_gpu_hours)  # the same allocation, the same link
    assert "shared verifier (submit.ablations: 3 variants from one capture)" in format_plan(ablations)
