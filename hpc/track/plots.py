"""PNG plots people would rather look at than read: written atomically, logged to MLflow."""

from __future__ import annotations

from pathlib import Path


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # compute nodes have no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    from hpc.fsio import atomic_path

    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=out.suffix.lstrip(".") or "png")
    return out


def loss_curve_png(losses: list[float], out: str | Path, title: str = "") -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title} training loss".strip())
    ax.grid(alpha=0.3)
    path = _save(fig, Path(out))
    plt.close(fig)
    return path


def loss_curves_png(series: dict[str, list[float]], out: str | Path, title: str = "") -> Path:
    """Several runs' training loss on one axis (an ablation at equal budget)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, losses in series.items():
        ax.plot(range(1, len(losses) + 1), losses, lw=1.0, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title} training loss".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = _save(fig, Path(out))
    plt.close(fig)
    return path


def per_position_png(per_bench: dict[str, list[float]], out: str | Path, title: str = "") -> Path:
    """Acceptance rate of draft position i, one line per benchmark."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rates in per_bench.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", lw=1.2, label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title} per-position acceptance".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = _save(fig, Path(out))
    plt.close(fig)
    return path
