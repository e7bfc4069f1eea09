"""Training loop and greedy decoding for the toy targets (see toy.py).

Deterministic for a seed: one torch.Generator drives the data order, torch.manual_seed the init,
and CPU fp32 kernels run in a fixed order for a fixed thread count.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hpc.verifier.toy import ToyConfig


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, separated by the end-of-text token."""
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tok.pad_token_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, chat: dict[str, list[int]], cfg: "ToyConfig", gen: torch.Generator) -> torch.Tensor:
    """cfg.batch_size windows of cfg.seq_len ids; some wrapped as a user turn + assistant reply.

    The chat windows teach the toy its template, so a chat-formatted prompt (as the data
    regeneration stage sends) continues with text instead of noise.
    """
    rows = []
    for _ in range(cfg.batch_size):
        start = int(torch.randint(0, len(stream) - cfg.seq_len, (1,), generator=gen))
        window = stream[start : start + cfg.seq_len].tolist()
        if float(torch.rand((), generator=gen)) < cfg.chat_fraction:
            body = cfg.seq_len - len(chat["user"]) - len(chat["assistant"]) - 1
            split = int(torch.randint(4, max(5, body // 2), (1,), generator=gen))
            window = chat["user"] + window[:split] + chat["assistant"] + window[split:body] + chat["end"]
        rows.append(window)
    return torch.tensor(rows, dtype=torch.long)


def chat_markers(tok) -> dict[str, list[int]]:
    from hpc.verifier.toy import ASSISTANT, END, MIDDLE, USER

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return {
        "user": enc(f"{USER}user{MIDDLE}"),
        "assistant": enc(f"{END}{ASSISTANT}assistant{MIDDLE}"),
        "end": enc(END),
    }


def lr_at(step: int, cfg: "ToyConfig") -> float:
    """Linear warmup, then cosine down to a tenth."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, tok, texts: list[str], cfg: "ToyConfig", progress: bool = False) -> float:
    """Train in place; return the mean loss over the last few steps (nan for steps=0)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    stream = token_stream(tok, texts)
    chat = chat_markers(tok)
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
            batch = sample_batch(stream, chat, cfg, gen)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent = (recent + [loss.item()])[-10:]
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
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    return prompt + tok.decode(greedy_ids(model, ids, max_new_tokens))
