"""Export in the format vLLM serves, and back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpc.errors import UserError
from hpc.model.export import as_served, export_draft, load_draft, shapes_only_inventory
from tests.fixtures.recipes import NO_VLLM, resolve_recipe
from tests.model.test_dspark import tiny_model

ROOT = Path(__file__).resolve().parents[2]
DSPARK_KEYS = {
    "speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size", "block_size",
    "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov", "target_hidden_size", "speculators_config",
}


def test_dspark_export_round_trips_bit_exact(tmp_path):
    model = tiny_model()
    out = export_draft(model, tmp_path / "draft", verifier="/models/toy", verifier_arch=["Qwen3ForCausalLM"], n=4)
    cfg = json.loads((out / "config.json").read_text())
    assert DSPARK_KEYS <= set(cfg)
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["sample_from_anchor"] is True
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == model.args.target_vocab_size and layer["rope_theta"] == model.args.rope_theta
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "dspark" and sc["verifier"]["name_or_path"] == "/models/toy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 4}

    tensors = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("model.") for k in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # vLLM holds the confidence head in fp32: so does the export (a folded head must not round).
    assert {k: t.dtype for k, t in tensors.items() if k.startswith("confidence_head.")} == {
        "confidence_head.proj.weight": torch.float32, "confidence_head.proj.bias": torch.float32}
    assert {t.dtype for k, t in tensors.items() if k not in ("d2t", "t2d") and not k.startswith("confidence_head.")} \
        == {torch.bfloat16}

    # Shared: other users' jobs serve and evaluate it (safetensors alone writes 0600).
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"config.json": 0o644,
                                                                        "model.safetensors": 0o644}
    assert out.stat().st_mode & 0o777 == 0o755
    back = load_draft(out)
    for name, ref in model.state_dict().items():
        want = ref if name in ("d2t", "t2d") or name.startswith("confidence_head.") else ref.to(torch.bfloat16).float()
        assert torch.equal(back.state_dict()[name], want), name
    # Re-exporting the import is byte-identical: nothing is lost on the way back.
    again = export_draft(back, tmp_path / "again", verifier="/models/toy", verifier_arch=["Qwen3ForCausalLM"], n=4)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_as_served_holds_the_exports_weights_and_leaves_the_model(tmp_path):
    """The calibration is fitted on as_served(model): it must compute what the export computes."""
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    served = as_served(model)
    back = load_draft(export_draft(model, tmp_path / "draft", n=4))
    for name, t in served.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
        assert torch.equal(model.state_dict()[name], before[name]), name  # the training weights stay
    assert any(not torch.equal(served.state_dict()[k], before[k]) for k in before)  # bf16 rounding bites


def test_dflash_ablation_exports_as_dflash(tmp_path):
    model = tiny_model(markov_rank=0, enable_confidence_head=False, sample_from_anchor=False)
    cfg = json.loads((export_draft(model, tmp_path / "d") / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == model.args.block_size - 1
    assert not any("markov" in k or "confidence" in k for k in load_file(str(tmp_path / "d" / "model.safetensors")))
    with pytest.raises(UserError, match="sample_from_anchor=false"):
        export_draft(tiny_model(markov_rank=0, enable_confidence_head=False), tmp_path / "bad")


def test_mismatched_checkpoint_names_tensor_and_shapes(tmp_path):
    out = export_draft(tiny_model(), tmp_path / "draft")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :10].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=r"fc.weight: shape \(32, 10\) in the file, config says \(32, 96\)"):
        load_draft(out)


def test_d2t_outside_target_vocab_is_rejected(tmp_path):
    out = export_draft(tiny_model(), tmp_path / "draft")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 1000
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="outside the target vocab"):
        load_draft(out)


def test_kimi_inventory_is_the_published_44_tensors_6_3_gb():

    cfg = resolve_recipe(ROOT / "configs" / "kimi-k2.6-dspark.yaml")
    rows = shapes_only_inventory(cfg.draft)
    assert len(rows) == 44
    total = sum(r[3] for r in rows)
    assert 6.25e9 < total < 6.35e9
    assert dict((r[0], r[1]) for r in rows)["markov_head.markov_w1.weight"] == (163840, 256)


@pytest.mark.slow
def test_cli_export_and_shapes_only(tmp_path):
    ckpt = export_draft(tiny_model(), tmp_path / "ckpt")
    run = subprocess.run([sys.executable, "-m", "hpc", "export", str(ckpt), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    shapes = subprocess.run([sys.executable, "-m", "hpc", "export", "--shapes-only",
                             "configs/kimi-k2.6-dspark.yaml", *NO_VLLM], capture_output=True, text=True, cwd=ROOT)
    assert shapes.returncode == 0 and "44 tensors, 6.30 GB" in shapes.stdout
    # A reader that leaves early is no error (a rich Console made it exit 1 with nothing said).
    piped = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m hpc export --shapes-only "
                            f"configs/kimi-k2.6-dspark.yaml {' '.join(NO_VLLM)} | head -1"],
                           capture_output=True, text=True, cwd=ROOT)
    assert piped.returncode == 0 and piped.stdout.startswith("kimi-k2.6-dspark: exported tensors"), piped.stderr
    missing = subprocess.run([sys.executable, "-m", "hpc", "export", str(tmp_path / "nope"), str(tmp_path / "x")],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and "not a draft export" in missing.stderr and "Traceback" not in missing.stderr


def test_mask_token_outside_vocab_is_rejected(tmp_path):
    out = export_draft(tiny_model(), tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    cfg["mask_token_id"] = cfg["transformer_layer_config"]["vocab_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="mask_token_id 64 is outside the target vocab"):
        load_draft(out)


def _export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", "export", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_export_never_replaces_a_directory_that_is_not_an_export(tmp_path):
    ckpt = export_draft(tiny_model(), tmp_path / "run" / "checkpoints" / "step_00000001")
    precious = tmp_path / "run" / "notes.txt"
    precious.write_text("keep me")
    res = _export_cli(str(ckpt), str(tmp_path / "run"))  # the training run itself as OUT: it holds the checkpoint
    assert res.returncode == 2 and "overlap" in res.stderr and len(res.stderr.splitlines()) == 1
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me too")
    res = _export_cli(str(ckpt), str(notes))  # a directory of something else
    assert res.returncode == 2 and "not a draft export" in res.stderr and len(res.stderr.splitlines()) == 1
    assert (notes / "todo.txt").read_text() == "keep me too"
    assert precious.read_text() == "keep me" and (ckpt / "model.safetensors").is_file()
    same = _export_cli(str(ckpt), str(ckpt))
    assert same.returncode == 2 and "Traceback" not in same.stderr
    # An earlier export is replaced whole, and no temp or aside directory is left behind.
    assert _export_cli(str(ckpt), str(tmp_path / "out")).returncode == 0
    assert _export_cli(str(ckpt), str(tmp_path / "out")).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "out", "run"]


@pytest.mark.parametrize("n", ["0", "9", "-1"])
def test_export_n_outside_the_block_is_refused_before_writing(tmp_path, n):
    ckpt = export_draft(tiny_model(), tmp_path / "ckpt")
    block = json.loads((ckpt / "config.json").read_text())["block_size"]
    res = _export_cli(str(ckpt), str(tmp_path / "out"), "--n", n)
    assert res.returncode == 2 and f"1..{block}" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_a_dflash_layout_draft_never_advertises_a_slot_it_did_not_train(tmp_path):
    """Slot 0 is the bonus there, so it proposes block_size - 1: vLLM runs the advertised n
    when none is asked for. n=0 also became "all" silently."""
    model = tiny_model(markov_rank=0, enable_confidence_head=False, sample_from_anchor=False)
    block = model.args.block_size
    for n in (block, 0, -3):
        with pytest.raises(UserError, match=f"proposes 1..{block - 1}"):
            export_draft(model, tmp_path / f"bad{n}", n=n)
        assert not (tmp_path / f"bad{n}").exists()
    ckpt = export_draft(model, tmp_path / "ckpt")
    res = _export_cli(str(ckpt), str(tmp_path / "out"), "--n", str(block))
    assert res.returncode == 2 and f"1..{block - 1}" in res.stderr, res.stderr


def test_the_export_sizes_rope_for_the_targets_context(tmp_path):
    """Every export said 32768 positions: vLLM sizes the draft's RoPE cache from it, so a Kimi
    context past 32k failed (CPU) or read garbage (CUDA). It carries over a checkpoint re-export."""
    model = tiny_model(max_position_embeddings=262144)
    out = export_draft(model, tmp_path / "draft")
    assert json.loads((out / "config.json").read_text())["transformer_layer_config"][
        "max_position_embeddings"] == 262144
    again = export_draft(load_draft(out), tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["transformer_layer_config"][
        "max_position_embeddings"] == 262144



@pytest.mark.parametrize("damage", ["truncate weights", "truncate config", "drop a key"])
def test_a_damaged_draft_gives_one_line(tmp_path, damage):
    out = export_draft(tiny_model(), tmp_path / "draft")
    if damage == "truncate weights":
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "truncate config":
        text = (out / "config.json").read_text()
        (out / "config.json").write_text(text[: len(text) // 2])
    else:
        cfg = json.loads((out / "config.json").read_text())
        del cfg["block_size"]
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="damaged") as info:
        load_draft(out)
    assert "\n" not in str(info.value)


def test_the_out_directory_may_follow_a_flag(tmp_path):
    """`dspark export CKPT --n 3 OUT` said "unrecognized arguments: OUT"."""
    from hpc.cli import main

    ckpt = export_draft(tiny_model(), tmp_path / "ckpt")
    assert main(["export", str(ckpt), "--n", "3", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"][
        "proposal_methods"][0]["speculative_tokens"] == 3


def test_only_plain_files_make_an_export(tmp_path):
    from hpc.model.export import is_export

    out = export_draft(tiny_model(), tmp_path / "export", verifier="/models/toy",
                       verifier_arch=["Qwen3ForCausalLM"], n=4)
    assert is_export(out)
    link = tmp_path / "link"
    link.symlink_to(out)
    assert not is_export(link)  # replacing it would replace what it points at
    weights = next(p for p in out.iterdir() if p.suffix == ".safetensors")
    elsewhere = tmp_path / "elsewhere.safetensors"
    weights.rename(elsewhere)
    weights.symlink_to(elsewhere)
    assert not is_export(out)
    weights.unlink()
    weights.mkdir()
    assert not is_export(out)


def test_export_into_its_own_tree_is_one_line_before_any_copy(tmp_path, monkeypatch):
    from hpc.model.export_cli import export

    ckpt = export_draft(tiny_model(), tmp_path / "ckpt")
    out = export_draft(tiny_model(seed=1), tmp_path / "export")
    before = {p: p.read_bytes() for p in [*ckpt.iterdir(), *out.iterdir()]}
    monkeypatch.chdir(out)  # `dspark export CKPT .` from inside an earlier export
    for target, says in ((".", "is the current directory or holds it"), (str(tmp_path), "overlap"),
                         (str(ckpt / "sub"), "overlap"), (str(ckpt), "the checkpoint itself")):
        with pytest.raises(UserError, match=says):
            export(str(ckpt), target, None)
    # Nothing copied, nothing replaced: no temp weights left in OUT or beside it.
    assert {p: p.read_bytes() for p in [*ckpt.iterdir(), *out.iterdir()]} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]
