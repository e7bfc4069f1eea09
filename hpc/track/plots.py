"""PNG plots people would rather look at than read: written atomically, logged to MLflow."""

from __future__ import annotations

import datetime
from pathlib import Path

from hpc.fsio import atomic_path


def _figure():
    import matplotlib  # matplotlib: loaded only on this path

    matplotlib.use("Agg")  # compute nodes have no display
    import matplotlib.pyplot as plt  # matplotlib: loaded only on this path

    return plt


def _save(fig, out: Path) -> Path:
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=out.suffix.lstrip(".") or "png")
    return out


def _lines_png(series: dict[str, list[float]], out: str | Path, xlabel: str, ylabel: str, title: str,
               legend: bool = True, ylim: tuple[float, float] | None = None, **style) -> Path:
    """One line per series against 1..len, on one axis."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title.strip())
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
    path = _save(fig, Path(out))
    plt.close(fig)
    return path


def loss_curve_png(losses: list[float], out: str | Path, title: str = "") -> Path:
    return _lines_png({"loss": losses}, out, "step", "loss", f"{title} training loss", legend=False, lw=1.2)


def loss_curves_png(series: dict[str, list[float]], out: str | Path, title: str = "") -> Path:
    """Several runs' training loss on one axis (an ablation at equal budget)."""
    return _lines_png(series, out, "step", "loss", f"{title} training loss", lw=1.0)


def per_position_png(per_bench: dict[str, list[float]], out: str | Path, title: str = "") -> Path:
    """Acceptance rate of draft position i, one line per benchmark."""
    return _lines_png(per_bench, out, "draft position", "acceptance rate", f"{title} per-position acceptance",
                      ylim=(0, 1), marker="o", lw=1.2)


def live_tau_png(times: list[float], taus: list[float], evaluated: float, line: float, out: str | Path,
                 title: str = "") -> Path:
    """A served draft's live acceptance length per watch tick, against its evaluated one and the
    drift line below which the ticks count toward a retrain."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    when = [datetime.datetime.fromtimestamp(t) for t in times]
    ax.plot(when, taus, marker="o", lw=1.2, label="live (per tick)")
    ax.axhline(evaluated, color="tab:green", lw=1.0, label=f"evaluated {evaluated:.2f}")
    ax.axhline(line, color="tab:red", lw=1.0, ls="--", label=f"drift line {line:.2f}")
    ax.set_xlabel("tick")
    ax.set_ylabel("acceptance length")
    ax.set_title(f"{title} live acceptance".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.autofmt_xdate()
    path = _save(fig, Path(out))
    plt.close(fig)
    return path
