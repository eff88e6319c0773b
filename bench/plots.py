"""What every benchmark plot shares: matplotlib imported headless (or a hint where it is missing), the finishing
touches of an axis, saving."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot drawing headless, or None (and a hint) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: pip install matplotlib")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
