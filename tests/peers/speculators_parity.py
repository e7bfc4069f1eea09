"""Our DSpark draft against speculators' DSparkDraftModel on the same export and the same row.

Runs with the speculators venv's python and PYTHONPATH=<repo> (our `hpc.model` needs only
torch + safetensors). Both models load the SAME bf16 export and run in fp32, so weights are
bit-identical and any difference is the computation. Anchors are deterministic: max_anchors
equals the number of valid positions, so speculators' random pick takes them all (sorted).

    python speculators_parity.py CASE=EXPORT_DIR [...]  ->  one JSON object on stdout

Per case: max abs differences of the Markov-corrected draft logits, the confidence logits and
the verifier targets; speculators' loss terms vs our `objective` on speculators' own
logits/targets/mask; and, where the supervision masks agree by construction (one document,
sample_from_anchor=True), speculators' loss vs our end-to-end `dspark_loss`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import speculators.models.dspark.core as spec_core
import torch
from speculators.losses import eager as spec_eager
from speculators.losses import resolve_loss_config
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

from hpc.formats.draft_args import ConfidenceTarget, LossArgs
from hpc.model.blocks import make_blocks, select_anchors, tiled_sdpa_attention_fn
from hpc.model.dspark import DSparkDraft
from hpc.model.export import load_draft
from hpc.model.loss import PackedRow, VerifierHead, dspark_loss, objective

# speculators trains the confidence head on 1 - TV: compare against our "sampling" target.
WEIGHTS = LossArgs(ce_weight=0.1, tv_weight=0.9, kl_weight=0.0, decay_gamma=4.0, confidence_weight=1.0,
                   confidence_target=ConfidenceTarget.sampling)


def load_theirs(export: Path) -> DSparkDraftModel:
    cfg = DSparkSpeculatorConfig.from_pretrained(str(export))
    # Their default is flex attention with a compiled block mask; on CPU eager is the reference.
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = DSparkDraftModel.from_pretrained(str(export), config=cfg, dtype=torch.float32)
    return model.eval()


def same_weights(ours: DSparkDraft, theirs: DSparkDraftModel) -> list[str]:
    """Names whose tensors differ or are missing on their side (empty = identical)."""
    sd = theirs.state_dict()
    return [k for k, v in ours.state_dict().items() if k not in sd or not torch.equal(sd[k].to(v.dtype), v)]


def make_row(ours: DSparkDraft, docs: list[int], seed: int) -> PackedRow:
    a = ours.args
    g = torch.Generator().manual_seed(seed)
    T = sum(docs)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    pos = torch.cat([torch.arange(n) for n in docs])
    loss_mask = torch.ones(T, dtype=torch.long)
    starts = [sum(docs[:i]) for i in range(len(docs))]
    for s in starts:  # each document opens with a 3-token prompt
        loss_mask[s:s + 3] = 0
    ids = torch.randint(0, a.target_vocab_size, (T,), generator=g)
    aux = torch.randn(T, len(a.aux_layer_ids), a.target_hidden_size, generator=g)
    last = torch.randn(T, a.target_hidden_size, generator=g)
    return PackedRow(ids, loss_mask, aux, last, doc_ids, pos)


def run_case(export: Path, docs: list[int], seed: int = 0) -> dict:
    ours, theirs = load_draft(export), load_theirs(export)
    a, B = ours.args, ours.args.block_size
    out: dict = {"weights_differ": same_weights(ours, theirs), "sample_from_anchor": a.sample_from_anchor}
    row = make_row(ours, docs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    lm_head_VH = torch.randn(a.target_vocab_size, a.target_hidden_size, generator=g)
    norm_H = 1.0 + 0.1 * torch.randn(a.target_hidden_size, generator=g)
    # speculators always applies the verifier's final norm to the captured last hidden.
    head = VerifierHead(lm_head_VH, ours.t2d.bool(), norm_H, eps=a.rms_norm_eps)
    with torch.no_grad():
        theirs.verifier_lm_head.weight.copy_(lm_head_VH[ours.t2d.bool()])
        theirs.verifier_norm.weight.copy_(norm_H)

    n_valid = int(select_anchors(row.loss_mask_T, B, 10**9).numel())
    captured: dict = {}
    real_metrics = spec_core.compute_metrics

    def capture(logits, targets, confidence_logits, loss_mask, *args, **kw):
        captured.update(logits=logits, targets=targets, conf=confidence_logits, mask=loss_mask)
        return real_metrics(logits, targets, confidence_logits, loss_mask, *args, **kw)

    spec_core.compute_metrics = capture
    try:
        with torch.no_grad():
            _, loss_theirs, metrics = theirs(
                row.aux_TnH.flatten(1)[None], row.input_ids_T[None], row.loss_mask_T[None],
                row.last_hidden_TH[None], row.doc_ids_T[None], row.position_ids_T[None],
                loss_config=resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager"), tv_loss_fn=spec_eager.tv_loss,
                gamma=WEIGHTS.decay_gamma, max_anchors=n_valid, confidence_head_alpha=WEIGHTS.confidence_weight)
    finally:
        spec_core.compute_metrics = real_metrics

    anchors = select_anchors(row.loss_mask_T, B, n_valid)
    blocks = make_blocks(row.input_ids_T, row.loss_mask_T, row.position_ids_T, row.doc_ids_T, anchors, B,
                         a.mask_token_id, a.sample_from_anchor)
    with torch.no_grad():
        ctx = ours.project_context(row.aux_TnH)
        # Our CPU training attention, in small tiles so several straddle documents.
        attend = tiled_sdpa_attention_fn(anchors, row.doc_ids_T, B, tile_slots=3 * B)
        h = ours.backbone(ctx, row.position_ids_T, blocks.block_ids_NB.flatten(), blocks.block_pos_NB.flatten(), attend)
        logits, conf = ours.heads(h, blocks.prev_ids_NB.flatten())
        targets = head(row.last_hidden_TH[blocks.target_idx_NB.flatten()])
        ours_loss, _ = dspark_loss(ours, row, head, WEIGHTS, n_valid, attention="sdpa", anchors_N=anchors)

    N = anchors.numel()
    # DFlash layout: slot 0 is the bonus token, never sampled nor supervised; speculators feeds it
    # the anchor as Markov input, we the token before it. Compare the slots that draft.
    first = 0 if a.sample_from_anchor else 1

    def diff(x, y) -> float:
        return float((x.reshape(N, B, -1)[:, first:] - y.reshape(N, B, -1)[:, first:]).abs().max())

    out.update(n_anchors=N, docs=docs,
               logits_max_abs_diff=diff(logits, captured["logits"][0]),
               conf_max_abs_diff=diff(conf, captured["conf"][0]),
               targets_max_abs_diff=diff(targets, captured["targets"][0]),
               logits_scale=float(logits.abs().max()))
    # Our objective on THEIR logits/targets/mask: isolates the loss maths (CE, TV, decay, BCE).
    mask_NB = captured["mask"][0].view(N, B).bool()
    loss_o, parts, _ = objective(captured["logits"][0].view(N, B, -1), captured["targets"][0].view(N, B, -1),
                                 mask_NB, captured["conf"][0].view(N, B), WEIGHTS, a.sample_from_anchor)
    out["objective"] = {
        "loss": [float(loss_o), float(loss_theirs)],
        "ce": [float(parts["ce"]), float(metrics["ce_loss_sum"])],
        "tv": [float(parts["tv"]), float(metrics["tv_loss_sum"])],
        "confidence": [float(parts["confidence"]), float(metrics["confidence_loss_sum"])],
    }
    out["end_to_end_loss"] = [float(ours_loss), float(loss_theirs)]
    out["masks_agree"] = bool(torch.equal(blocks.valid_NB, mask_NB))
    # We never supervise a slot whose target lies in the next packed document (its context is
    # invisible to the block); speculators does. Count where the supervised slots differ.
    cross_doc = row.doc_ids_T[blocks.target_idx_NB] != row.doc_ids_T[anchors][:, None]
    only_theirs = mask_NB & ~blocks.valid_NB
    out["mask_diff"] = {"only_ours": int((blocks.valid_NB & ~mask_NB).sum()), "only_theirs": int(only_theirs.sum()),
                        "only_theirs_cross_doc": int((only_theirs & cross_doc).sum())}
    return out


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    results = {}
    for spec in argv:
        name, _, rest = spec.partition("=")
        export, _, docs = rest.partition(":")
        results[name] = run_case(Path(export), [int(d) for d in docs.split(",")] if docs else [40])
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
