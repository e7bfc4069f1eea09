"""Training loop and greedy decoding for the toy targets (see toy.py).

Deterministic for a seed: one torch.Generator drives the data order, torch.manual_seed the init,
and CPU fp32 kernels run in a fixed order for a fixed thread count.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

if TYPE_CHECKING:
    from hpc_dev.toy_config import ToyConfig


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, separated by the end-of-text token."""
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tok.pad_token_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, cfg: ToyConfig, gen: torch.Generator) -> torch.Tensor:
    """cfg.batch_size random windows of cfg.seq_len ids from the stream of rendered exchanges."""
    starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[int(i): int(i) + cfg.seq_len] for i in starts])


def lr_at(step: int, cfg: ToyConfig) -> float:
    """Linear warmup, then cosine down to a tenth."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def objective(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, special_V: torch.Tensor,
              unlikelihood: float, window: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to optimise, next-token cross-entropy) for one batch of windows.

    The loss adds token-level unlikelihood (Welleck et al., 2019): at each position, every
    ordinary token already seen in the window, other than the true next one, is pushed down by
    -log(1 - p), over the last `window` tokens. A model this small otherwise settles into greedy loops ("the value of the
    value of the ..."), and a target that loops makes any draft look good.
    """
    logits = logits_BTV[:, :-1].float()
    target_BT = ids_BT[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_BT.flatten())
    if unlikelihood <= 0:
        return ce, ce
    # The last `window` tokens at each position (a repeat loop lives in them), gathered rather
    # than masked over the whole vocab: [B, T, W] instead of [B, T, V].
    T = target_BT.shape[1]
    padded_BT = torch.nn.functional.pad(ids_BT[:, :-1], (window - 1, 0), value=-1)
    prev_BTW = padded_BT.unfold(1, window, 1)[:, :T]
    keep_BTW = (prev_BTW >= 0) & (prev_BTW != target_BT[..., None])
    keep_BTW &= ~special_V[prev_BTW.clamp(min=0)]  # chat markers recur by design: ending a turn is no loop
    p_BTW = torch.softmax(logits, -1).gather(2, prev_BTW.clamp(min=0))
    # A token seen twice in the window is pushed down once.
    first_BTW = torch.ones_like(keep_BTW)
    for k in range(1, window):
        first_BTW[..., :-k] &= prev_BTW[..., :-k] != prev_BTW[..., k:]
    ul = -(torch.log1p(-p_BTW.clamp(max=1 - 1e-5)) * (keep_BTW & first_BTW)).sum(-1).mean()
    return ce + unlikelihood * ul, ce


def train(model, tok, texts: list[str], cfg: ToyConfig, progress: bool = False) -> float:
    """Train in place; return the mean cross-entropy over the last few steps (nan for steps=0)."""
    stream = token_stream(tok, texts)
    special_V = torch.zeros(len(tok), dtype=torch.bool)
    special_V[tok.all_special_ids] = True
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    recent: list[float] = []
    bar = Progress(
        TextColumn(f"training toy {cfg.arch}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(), disable=not progress,
    )
    with bar:
        task = bar.add_task("train", total=cfg.steps, loss=float("nan"))
        for step in range(cfg.steps):
            batch = sample_batch(stream, cfg, gen)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss, ce = objective(model(input_ids=batch).logits, batch, special_V, cfg.unlikelihood,
                                 cfg.unlikelihood_window)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent = (recent + [ce.item()])[-10:]
            bar.update(task, advance=1, loss=recent[-1])
    return sum(recent) / len(recent) if recent else float("nan")


@torch.no_grad()
def greedy_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recompute: slow but free of cache subtleties (a reference)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def greedy_sample(model, tok, prompt: str, max_new_tokens: int = 32) -> str:
    """The greedy reply to an already rendered prompt, up to the end of the turn."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out = greedy_ids(model, ids, max_new_tokens)
    if tok.eos_token_id in out:
        out = out[:out.index(tok.eos_token_id)]
    return tok.decode(out)
