"""Worker of `dspark-dev bench train-step`: runs inside the speculators venv (PYTHONPATH=<repo>).

    python -m hpc_dev.bench_train_step '<json config>'  ->  one JSON line: per-iteration seconds

One DSpark draft is exported once and loaded by both sides (identical weights); both train on
the same packed row (batch x seq_len tokens, `anchors` per sequence) with CE 0.1 + TV 0.9 +
confidence BCE and AdamW. The trainable sets are made equal (speculators' recipe: the frozen
verifier embedding and draft lm_head are not trained), else the two steps would not do the
same work. Iterations alternate ours/theirs so drift in machine load hits both alike.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hpc.formats.draft_args import ConfidenceTarget, DraftArgs, LossArgs
from hpc.model.dspark import DSparkDraft
from hpc.model.export import export_draft, load_draft
from hpc.model.loss import PackedRow, dspark_loss
from hpc.model.teacher import LogitTransform, VerifierHead

# speculators' recipe trains the confidence head on 1 - TV: the same work as ours on greedy matches.
WEIGHTS = LossArgs(ce_weight=0.1, tv_weight=0.9, kl_weight=0.0, decay_gamma=4.0, confidence_weight=1.0,
                   confidence_target=ConfidenceTarget.sampling)
LR = 1e-4


def draft_args(c: dict) -> DraftArgs:
    return DraftArgs(
        hidden_size=c["hidden"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], head_dim=c["hidden"] // c["heads"], intermediate_size=3 * c["hidden"],
        block_size=c["block_size"], draft_vocab_size=c["draft_vocab"], mask_token_id=c["target_vocab"] - 1,
        markov_rank=c["markov_rank"], target_hidden_size=c["hidden"], target_vocab_size=c["target_vocab"],
        aux_layer_ids=[1, 2, 3], rope_theta=1e6,
    )


def random_draft(args: DraftArgs, g: torch.Generator) -> DSparkDraft:
    model = DSparkDraft(args)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
        kept = torch.sort(torch.randperm(args.target_vocab_size - 1, generator=g)[:args.draft_vocab_size]).values
        model.d2t.copy_(kept - torch.arange(args.draft_vocab_size))
        model.t2d.zero_()
        model.t2d[kept] = True
    return model


def packed_row(c: dict, g: torch.Generator) -> PackedRow:
    S, n, H = c["seq_len"], c["batch"], c["hidden"]
    T = S * n
    loss_mask = torch.ones(T, dtype=torch.long)
    for i in range(n):  # each sequence opens with a prompt of S/8 tokens
        loss_mask[i * S:i * S + S // 8] = 0
    return PackedRow(
        torch.randint(0, c["target_vocab"] - 1, (T,), generator=g), loss_mask, torch.randn(T, 3, H, generator=g),
        torch.randn(T, H, generator=g), torch.arange(n).repeat_interleave(S), torch.arange(S).repeat(n),
    )


def load_theirs(export: Path, attn: str):
    # speculators: loaded only on this path
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    cfg = DSparkSpeculatorConfig.from_pretrained(str(export))
    cfg.transformer_layer_config._attn_implementation = attn
    return DSparkDraftModel.from_pretrained(str(export), config=cfg, dtype=torch.float32).train()


def build(c: dict, tmp: Path) -> tuple[Callable[[], None], Callable[[], None], dict]:
    from speculators.losses import eager, resolve_loss_config  # speculators: loaded only on this path

    g = torch.Generator().manual_seed(0)
    export = export_draft(random_draft(draft_args(c), g), tmp / "draft")
    ours, theirs = load_draft(export).train(), load_theirs(export, c["their_attn"])
    lm_head_VH = torch.randn(c["target_vocab"], c["hidden"], generator=g) * c["hidden"] ** -0.5
    norm_H = torch.ones(c["hidden"])
    head = VerifierHead(lm_head_VH, ours.t2d.bool(), norm_H, eps=ours.args.rms_norm_eps)
    with torch.no_grad():  # speculators always applies the verifier's final norm, then its lm_head rows
        theirs.verifier_lm_head.weight.copy_(lm_head_VH[ours.t2d.bool()])
        theirs.verifier_norm.weight.copy_(norm_H)
    for frozen in (ours.embed_tokens, ours.lm_head, theirs.embed_tokens, theirs.lm_head, theirs.verifier_lm_head,
                   theirs.verifier_norm):
        frozen.requires_grad_(False)
    params_o = [p for p in ours.parameters() if p.requires_grad]
    params_t = [p for p in theirs.parameters() if p.requires_grad]
    opt_o, opt_t = torch.optim.AdamW(params_o, lr=LR), torch.optim.AdamW(params_t, lr=LR)

    row = packed_row(c, g)
    assert row.doc_ids_T is not None and row.position_ids_T is not None  # packed_row passes both
    max_anchors = c["anchors"] * c["batch"]
    gen = torch.Generator().manual_seed(1)
    loss_config = resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager")  # fused losses need Triton + GPU
    inputs = (row.aux_TnH.flatten(1)[None], row.input_ids_T[None], row.loss_mask_T[None], row.last_hidden_TH[None],
              row.doc_ids_T[None], row.position_ids_T[None])

    def step_ours() -> None:
        loss, _ = dspark_loss(ours, row, head, WEIGHTS, max_anchors, gen, attention="sdpa")
        loss.backward()
        opt_o.step()
        opt_o.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        _, loss, _ = theirs(*inputs, loss_config=loss_config, tv_loss_fn=eager.tv_loss, gamma=WEIGHTS.decay_gamma,
                            max_anchors=max_anchors, confidence_head_alpha=WEIGHTS.confidence_weight)
        loss.backward()
        opt_t.step()
        opt_t.zero_grad(set_to_none=True)

    info = {"trainable_params": [sum(p.numel() for p in params_o), sum(p.numel() for p in params_t)]}
    return step_ours, step_theirs, info


def build_teacher(c: dict) -> tuple[Callable[[], None], Callable[[], None], dict]:
    """Our step twice, on one draft and row: with the identity teacher (Qwen3, Kimi) and with the
    heaviest transform in the table (Gemma 2: its (1 + w) final norm on a pre-norm capture, then
    a soft-cap), so the cost the teacher adds is the ratio of the two."""
    g = torch.Generator().manual_seed(0)
    model = random_draft(draft_args(c), g).train()
    for frozen in (model.embed_tokens, model.lm_head):
        frozen.requires_grad_(False)
    lm_head_VH = torch.randn(c["target_vocab"], c["hidden"], generator=g) * c["hidden"] ** -0.5
    norm_H = torch.randn(c["hidden"], generator=g) * 0.1
    t2d = model.t2d.bool()
    heads = {"identity": VerifierHead(lm_head_VH, t2d, norm_H),
             "transform": VerifierHead(lm_head_VH, t2d, norm_H, transform=LogitTransform(norm="rms_1p", softcap=30.0))}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    row = packed_row(c, g)
    max_anchors = c["anchors"] * c["batch"]

    def step(head: VerifierHead) -> Callable[[], None]:
        def run() -> None:
            anchors_gen = torch.Generator().manual_seed(1)  # the same anchors on both sides
            loss, _ = dspark_loss(model, row, head, WEIGHTS, max_anchors, anchors_gen, attention="sdpa")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    return step(heads["identity"]), step(heads["transform"]), {"trainable_params": [sum(p.numel() for p in params)] * 2}


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    c = json.loads(argv[0])
    if c.get("threads"):
        torch.set_num_threads(c["threads"])
    torch.manual_seed(0)
    names = ("identity", "transform") if c.get("teacher") else ("ours", "speculators")
    if c.get("teacher"):
        step_ours, step_theirs, info = build_teacher(c)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            step_ours, step_theirs, info = build(c, Path(tmp))
    if info["trainable_params"][0] != info["trainable_params"][1]:
        raise SystemExit(f"trainable parameter counts differ: {info['trainable_params']}")
    for _ in range(c["warmup"]):
        step_ours()
        step_theirs()
    times: dict[str, list[float]] = {names[0]: [], names[1]: []}
    for i in range(c["iters"]):
        pair = [(names[0], step_ours), (names[1], step_theirs)]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            times[name].append(timed(fn))
    T = c["seq_len"] * c["batch"]
    desc = (f"H={c['hidden']} L={c['layers']} heads={c['heads']}/{c['kv_heads']} T={c['batch']}x{c['seq_len']} "
            f"anchors={c['anchors'] * c['batch']} B={c['block_size']} V_draft={c['draft_vocab']} "
            f"V_target={c['target_vocab']} r={c['markov_rank']} threads={torch.get_num_threads()} "
            f"{'teacher' if c.get('teacher') else 'their_attn=' + c['their_attn']} "
            f"trainable={info['trainable_params'][0]}")
    print(json.dumps({"config": desc, "tokens_per_step": T, "times": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
