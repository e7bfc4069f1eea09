"""The DSpark draft: a DFlash backbone plus a Markov logit-bias head and a confidence head.

Read top to bottom:
1. the verifier's aux hidden states at the context positions are concatenated, projected by
   `fc` and normalised by `hidden_norm`: that is the draft's context;
2. a block `[anchor, MASK x (B-1)]` is embedded with the verifier's frozen `embed_tokens` and
   run through Qwen3 layers whose keys/values span [context | block] (block bidirectional);
3. the final `norm` and `lm_head` give logits over the pruned draft vocab;
4. the Markov head adds `markov_w2(markov_w1[prev])`, where prev is the token before the one
   the slot predicts (ground truth in training, sampled left to right in decoding);
5. the confidence head maps `[h ; markov_w1[prev]]` to the logit that the slot is accepted.

`markov_rank=0` with `enable_confidence_head=False` is exactly DFlash.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from hpc.errors import UserError
from hpc.formats.draft_args import DraftArgs
from hpc.model.layers import AttentionFn, DecoderLayer, RMSNorm, rope_cos_sin


# What decoding asks of a confidence map. Protocols, not imports: the fitting modules
# (hpc.calibration.fit, hpc.calibration.fold) import this one, and imports go one way.
class PositionMaps(Protocol):
    def apply(self, logit: torch.Tensor, mode: str, position: int) -> torch.Tensor: ...


class AffineMap(Protocol):
    def logit(self, z: torch.Tensor) -> torch.Tensor: ...


class MarkovHead(nn.Module):
    """Low-rank first-order bias: what usually follows the previous token."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)


class DSparkDraft(nn.Module):
    d2t: torch.Tensor  # buffers, registered in __init__
    t2d: torch.Tensor

    def __init__(self, args: DraftArgs):
        super().__init__()
        a = self.args = args
        if not 0 <= a.mask_token_id < a.target_vocab_size:
            raise UserError(f"mask_token_id {a.mask_token_id} is outside the target vocab 0..{a.target_vocab_size - 1}; "
                            "use a reserved id of the target tokenizer (draft.mask_token_id)")
        n_aux = len(a.aux_layer_ids)
        self.embed_tokens = nn.Embedding(a.target_vocab_size, a.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(n_aux * a.target_hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         a.intermediate_size, a.rms_norm_eps)
            for _ in range(a.num_hidden_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(a.target_vocab_size, a.draft_vocab_size, a.markov_rank) if a.markov_rank else None
        with_markov = a.confidence_head_with_markov and a.markov_rank > 0
        self.confidence_head = (
            ConfidenceHead(a.hidden_size + (a.markov_rank if with_markov else 0))
            if a.enable_confidence_head else None
        )
        self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(a.target_vocab_size, dtype=torch.bool))
        # hpc.formats.calibration.Calibration, fitted after training: the confidences decoding reads
        # become the chance its mode accepts. Not a weight: it travels beside the export.
        self.confidence_calibration: PositionMaps | None = None
        # hpc.formats.calibration.Fold: the affine map the export folds into the head's weights, which
        # is what vLLM serves. The weights here stay the raw head's (training, calibration and warm
        # starts read those); `hpc.model.export` folds on the way out and unfolds on the way in.
        self.confidence_fold: AffineMap | None = None

    # -- 1. context ---------------------------------------------------------------------------
    def project_context(self, aux_TnH: torch.Tensor) -> torch.Tensor:
        """[T, n_aux, H_target] (ascending layer ids) -> [T, H]."""
        return self.hidden_norm(self.fc(aux_TnH.flatten(-2).to(self.fc.weight.dtype)))

    def context_kv(self, ctx_TH: torch.Tensor, ctx_pos_T: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V over the context: computed once, it serves every chunk of blocks
        drafted after the same context (calibration drafts a 20k-token row ~40 chunks at a time)."""
        a = self.args
        cos, sin = rope_cos_sin(ctx_pos_T, a.head_dim, a.rope_theta, ctx_TH.dtype)
        return [cast(DecoderLayer, layer).self_attn.context_kv(ctx_TH, cos, sin) for layer in self.layers]

    # -- 2. backbone --------------------------------------------------------------------------
    def backbone(
        self, ctx_TH: torch.Tensor, ctx_pos_T: torch.Tensor, block_ids_Q: torch.Tensor,
        block_pos_Q: torch.Tensor, attention: AttentionFn,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm for every block slot, [Q, H]. `ctx_kv`: what
        `context_kv` gave for this context, instead of computing it again."""
        a = self.args
        dtype = ctx_TH.dtype
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos_T, a.head_dim, a.rope_theta, dtype)
        cos, sin = rope_cos_sin(block_pos_Q, a.head_dim, a.rope_theta, dtype)
        x_QH = self.embed_tokens(block_ids_Q).to(dtype)
        for i, layer in enumerate(self.layers):
            x_QH = layer(x_QH, cos, sin, ctx_TH, ctx_cos, ctx_sin, attention, None if ctx_kv is None else ctx_kv[i])
        return self.norm(x_QH)

    def block_inputs(self, anchor_ids_N: torch.Tensor) -> torch.Tensor:
        """[N, B] token ids: each block is [anchor, MASK, ..., MASK]."""
        ids_NB = torch.full((anchor_ids_N.numel(), self.args.block_size), self.args.mask_token_id,
                            dtype=torch.long, device=anchor_ids_N.device)
        ids_NB[:, 0] = anchor_ids_N
        return ids_NB

    # -- 3-5. heads ---------------------------------------------------------------------------
    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head.markov_w1(prev_ids)

    def logits(self, h_QH: torch.Tensor, prev_emb_Qr: torch.Tensor | None) -> torch.Tensor:
        logits_QD = self.lm_head(h_QH)
        if prev_emb_Qr is not None:
            assert self.markov_head is not None  # markov_embed gives None without it
            logits_QD = logits_QD + self.markov_head.markov_w2(prev_emb_Qr)
        return logits_QD

    def confidence_logit(self, h_QH: torch.Tensor, prev_emb_Qr: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = h_QH
        if self.args.confidence_head_with_markov and prev_emb_Qr is not None:
            feats = torch.cat([h_QH, prev_emb_Qr.to(h_QH.dtype)], dim=-1)
        return self.confidence_head.proj(feats).squeeze(-1)

    def heads(self, h_QH: torch.Tensor, prev_ids_Q: torch.Tensor,
              detach_confidence: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced heads: prev tokens are known (training). `detach_confidence`: the
        confidence head reads its features without passing gradients back into them."""
        emb = self.markov_embed(prev_ids_Q)
        if detach_confidence:
            conf = self.confidence_logit(h_QH.detach(), emb.detach() if emb is not None else None)
        else:
            conf = self.confidence_logit(h_QH, emb)
        return self.logits(h_QH, emb), conf

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- decoding: one block, Markov chain sampled left to right --------------------------------
    def block_hidden(self, ctx_TH: torch.Tensor, anchor_id: int, anchor_pos: int, width: int) -> torch.Tensor:
        """Final hidden states [width, H] of one block drafted at anchor_pos after ctx_TH."""
        device = ctx_TH.device
        ids = self.block_inputs(torch.tensor([anchor_id], device=device))[0, :width]
        pos = torch.arange(anchor_pos, anchor_pos + width, device=device)
        ctx_pos = torch.arange(ctx_TH.shape[0], device=device)
        return self.backbone(ctx_TH, ctx_pos, ids, pos, sdpa_attention(None))

    @torch.no_grad()
    def propose(
        self, ctx_TH: torch.Tensor, anchor_id: int, anchor_pos: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy draft of n tokens (target ids) after the anchor, and their confidences.

        The context holds positions 0..anchor_pos-1; with sample_from_anchor the block has n
        slots and slot k predicts token anchor_pos+k+1, otherwise slot 0 is the bonus and n+1
        slots run. Attention is unmasked: one block sees the whole context and itself.
        """
        drafts, confs = self._chain(ctx_TH, anchor_id, anchor_pos, n, lambda logits_1D: logits_1D.argmax(-1),
                                    "greedy")
        return drafts, confs

    @torch.no_grad()
    def propose_sampled(
        self, ctx_TH: torch.Tensor, anchor_id: int, anchor_pos: int, n: int, temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """n tokens sampled at `temperature`, their confidences, and the distribution each was
        drawn from over the TARGET vocab [n, V] (zero off the draft vocab): speculative
        sampling needs p(x) for its accept ratio and p itself for the residual."""
        probs: list[torch.Tensor] = []

        def pick(logits_1D: torch.Tensor) -> torch.Tensor:
            p_1D = torch.softmax(logits_1D.float() / temperature, -1)
            probs.append(p_1D[0])
            return torch.multinomial(p_1D, 1, generator=generator)[:, 0]

        drafts, confs = self._chain(ctx_TH, anchor_id, anchor_pos, n, pick, "sampling")
        p_kV = torch.zeros(len(probs), self.args.target_vocab_size, device=ctx_TH.device)
        targets = self.draft_to_target(torch.arange(self.args.draft_vocab_size, device=ctx_TH.device))
        p_kV[:, targets] = torch.stack(probs)
        return drafts, confs, p_kV

    def _chain(self, ctx_TH: torch.Tensor, anchor_id: int, anchor_pos: int, n: int, pick, mode: str = "greedy"):
        """The Markov chain left to right: `pick` turns slot logits [1, D] into a draft id [1];
        `mode` (greedy | sampling) picks the confidence calibration, when there is one."""
        a = self.args
        width = n if a.sample_from_anchor else n + 1
        if width > a.block_size:
            raise ValueError(f"n={n} needs {width} slots but the draft was trained with block_size={a.block_size}")
        device = ctx_TH.device
        h_QH = self.block_hidden(ctx_TH, anchor_id, anchor_pos, width)
        first = 0 if a.sample_from_anchor else 1
        out, confs = [], []
        prev = torch.tensor([anchor_id], device=device)
        for k in range(first, width):
            emb = self.markov_embed(prev)
            tok_d = pick(self.logits(h_QH[k:k + 1], emb))
            conf = self.confidence_logit(h_QH[k:k + 1], emb)
            if conf is not None:
                # The side file's maps read the raw logit; without them decoding reads what vLLM serves.
                if self.confidence_calibration is not None:
                    conf = self.confidence_calibration.apply(conf.float(), mode, k - first + 1)
                elif self.confidence_fold is not None:
                    conf = self.confidence_fold.logit(conf.float())
                confs.append(torch.sigmoid(conf.float()))
            prev = self.draft_to_target(tok_d)
            out.append(prev)
        return torch.cat(out), (torch.cat(confs) if confs else None)


def sdpa_attention(mask_QK: torch.Tensor | None) -> AttentionFn:
    """SDPA with an explicit boolean mask (True = may attend); None = unmasked."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_QK, enable_gqa=k.shape[-3] != q.shape[-3])
    return attend
