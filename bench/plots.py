"""The finishing touches every benchmark plot shares (matplotlib is imported by the caller, headless)."""
from __future__ import annotations

from pathlib import Path


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
