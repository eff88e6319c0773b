"""Loading matrix.yaml into cells: one (vendor, runner label, test group) each, with its command and budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

MATRIX_FILE = Path(__file__).with_name("matrix.yaml")


@dataclass(frozen=True)
class Cell:
    vendor: str
    group: str
    runners: tuple[str, ...]
    requires: str | None  # platform kind the cell needs, None for any machine
    budget_minutes: int
    markers: str | None = None
    command: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def pytest_args(self) -> list[str]:
        return ["-m", self.markers, "-q"] if self.markers else []


@dataclass(frozen=True)
class Matrix:
    vendors: dict[str, dict]
    cells: list[Cell]

    def column(self, vendor: str) -> list[Cell]:
        if vendor not in self.vendors:
            raise ValueError(f"unknown vendor {vendor!r}; the matrix has: {', '.join(self.vendors)}")
        return [c for c in self.cells if c.vendor == vendor]


def load_matrix(path: Path = MATRIX_FILE) -> Matrix:
    data = yaml.safe_load(path.read_text())
    cells = []
    for vendor, v in data["vendors"].items():
        for group, g in data["groups"].items():
            if g.get("gpu_only") and v.get("requires") is None:
                continue
            if g.get("cpu_only") and v.get("requires") is not None:
                continue
            if bool(g.get("markers")) == bool(g.get("command")):
                raise ValueError(f"group {group!r} needs exactly one of markers / command")
            cells.append(Cell(vendor, group, tuple(v["runners"]), v.get("requires"), int(g["budget_minutes"]),
                              g.get("markers"), g.get("command"), {k: str(x) for k, x in (g.get("env") or {}).items()}))
    return Matrix(data["vendors"], cells)
