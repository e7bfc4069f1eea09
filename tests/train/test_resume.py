"""Exact resume: interrupt at a random step, resume, and the loss curve is bit-identical."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from hpc.config.schema import TrainConfig
from hpc.formats.checkpoint_layout import list_checkpoints
from hpc.formats.vocab_map import mapping_from_selected
from hpc.model.dspark import DSparkDraft
from hpc.model.loss import VerifierHead
from hpc.model.target_weights import load_target_tensors
from hpc.train.epochs import local_micro_batches
from hpc.train.trainer import RequeueRequested, Trainer
from hpc.verifier.hf_backend import HFVerifier
from tests.fixtures.draft import toy_draft_args

V, H = 96, 32


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("target")
    Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def rows(n: int = 24) -> dict[int, tuple[list[int], list[int]]]:
    g = random.Random(0)
    out = {}
    for i in range(n):
        T = g.randint(12, 20)
        ids = [g.randrange(V - 1) for _ in range(T)]
        mask = [0] * 4 + [1] * (T - 4)
        out[i] = (ids, mask)
    return out


def train_cfg(**kw) -> TrainConfig:
    cfg = TrainConfig(lr=1e-3, warmup_steps=2, steps=8, global_batch_size=4, grad_accumulation=2, max_anchors=6,
                      checkpoint_interval=100, keep_checkpoints=2, device="cpu", dtype="float32",
                      dist_backend="gloo", attention="sdpa", seed=3)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def make_parts(target_dir, init_seed: int, **kw):
    """(train config, draft, verifier head, export config) for the random target."""
    tensors = load_target_tensors(target_dir)
    torch.manual_seed(init_seed)
    args = toy_draft_args(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, block_size=4, draft_vocab_size=64, mask_token_id=V - 1, markov_rank=8,
                      target_hidden_size=H, target_vocab_size=V, aux_layer_ids=[1, 2, 3])
    model = DSparkDraft(args)
    d2t, t2d = mapping_from_selected(torch.arange(64), V)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.embed_tokens.weight.data.copy_(tensors["embed_tokens"])
    head = VerifierHead(tensors["lm_head"], t2d)
    return train_cfg(**kw), model, head, args.to_config_json(None, [], 4)


def make_trainer(target_dir, out_dir, init_seed: int, group=None, control_group=None, **kw) -> tuple[Trainer, HFVerifier]:
    verifier = HFVerifier(str(target_dir), [1, 2, 3])
    cfg, model, head, export = make_parts(target_dir, init_seed, **kw)
    return Trainer(cfg, model, head, export, out_dir, group=group, control_group=control_group,
                   epoch_size=len(rows())), verifier


def run(trainer, verifier, max_steps=None):
    batches = local_micro_batches(verifier, rows(), trainer.micro_batch_size, 0, 1, seed=3,
                                  ledger=trainer.state.ledger, epoch=trainer.state.epoch)
    trainer.run(batches, max_steps=max_steps)
    return trainer.state.losses


def test_resume_is_bit_identical(target_dir, tmp_path):
    straight, verifier = make_trainer(target_dir, tmp_path / "a", init_seed=0)
    full = run(straight, verifier)
    assert len(full) == 8 and full[-1] < full[0]

    for cut in range(1, 8):  # every step, the epoch's last (6) and the next epoch's first (7) among them
        first, verifier = make_trainer(target_dir, tmp_path / f"b{cut}", init_seed=0)
        run(first, verifier, max_steps=cut)
        # A new process would start from a different init: only the checkpoint carries the state.
        second, verifier = make_trainer(target_dir, tmp_path / f"b{cut}", init_seed=12345)
        assert second.resume()
        assert second.state.step == cut
        resumed = run(second, verifier)
        assert resumed == full, f"cut at {cut}"
        for (name, a), b in zip(straight.model.state_dict().items(), second.model.state_dict().values()):
            assert torch.equal(a, b), (name, cut)
        # 24 samples, 4 per step, 8 steps: the second epoch began at step 7 and its ledger restarted.
        assert second.state.epoch == 1 and len(second.state.ledger) == 8, cut


def test_signal_checkpoints_and_asks_for_requeue(target_dir, tmp_path):
    trainer, verifier = make_trainer(target_dir, tmp_path, init_seed=0, keep_checkpoints=1)
    trainer.stop_requested = False

    def on_step(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR2)  # what Slurm sends 90 s before preemption
    batches = local_micro_batches(verifier, rows(), trainer.micro_batch_size, 0, 1, seed=3)
    with pytest.raises(RequeueRequested, match="step 3"):
        trainer.run(batches, on_step=on_step)
    assert [p.name for p in list_checkpoints(trainer.ckpt_dir)] == ["step_00000003"]


@pytest.mark.slow
def test_two_rank_gloo_ddp_keeps_replicas_identical(target_dir, tmp_path):
    import json

    import torch.multiprocessing as mp

    from hpc.net import free_port
    from tests.train import ddp_worker

    mp.start_processes(ddp_worker.main, args=(2, free_port(), str(target_dir), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 4  # all-reduced metrics
    assert r0["digest"] == r1["digest"]  # same weights on both replicas
    assert r0["ledger"] == r1["ledger"] and len(set(map(tuple, r0["ledger"]))) == 16  # 4 steps x 4 samples, none twice
    assert len(list((tmp_path / "checkpoints").glob("step_*/rank1.safetensors"))) == 1


@pytest.mark.slow
def test_a_rank_whose_row_has_no_anchor_does_not_hang_the_others(tmp_path):
    import json

    import torch.multiprocessing as mp

    from hpc.net import free_port
    from tests.train import ddp_worker

    mp.start_processes(ddp_worker.empty_row_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # same all-reduced metrics, same weights
    for m in r0["steps"]:
        # Averaged over the micro-batches that had slots: rank 1's empty row does not halve them.
        assert m["accept_len"] >= 1.0 and m["supervised_slots"] > 0 and m["loss"] > 0


def test_a_rank_whose_stream_ends_first_stops_every_rank_at_the_same_step(tmp_path):
    import json

    import torch.multiprocessing as mp

    from hpc.net import free_port
    from tests.train import ddp_worker

    mp.start_processes(ddp_worker.short_stream_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["step"] for r in range(2)]
    assert steps == [2, 2]


def test_capture_of_the_wrong_shape_stops_at_the_first_sample(target_dir, tmp_path):
    from hpc.errors import UserError
    from hpc.stream.sample import Capture, MicroBatch

    trainer, verifier = make_trainer(target_dir, tmp_path, init_seed=0)
    good = verifier.capture(0, *rows()[0])
    bad = Capture(1, good.input_ids_T, good.loss_mask_T, good.aux_TnH[:, :2], good.last_hidden_TH)
    with pytest.raises(UserError, match=r"aux \(\d+, 2, 32\).*expects aux \(\d+, 3, 32\)"):
        trainer.step([MicroBatch([good, bad], [(0, 0), (0, 1)])])


def test_resume_takes_a_checkpoint_path_given_as_a_string(target_dir, tmp_path):
    first, _ = make_trainer(target_dir, tmp_path / "a", init_seed=0)
    path = first.checkpoint()
    second, _ = make_trainer(target_dir, tmp_path / "b", init_seed=1)
    assert second.resume(str(path))  # a str used to fail on `path.name`, after loading
    assert second.state.step == first.state.step


def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path):
    """Each rank picked its own newest checkpoint: a shared filesystem's stale client cache then
    resumed the ranks from different steps, and DDP trained them apart."""
    import json

    import torch.multiprocessing as mp

    from hpc.net import free_port
    from tests.train import ddp_worker

    mp.start_processes(ddp_worker.resume_choice_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["step"] for r in range(2)] == [4, 4]
