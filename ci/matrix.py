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

    def column(self, vendor: str, runner: str | None = None) -> list[Cell]:
        """The vendor's cells; with a runner label, those that run there (multi-GPU groups on multi-GPU runners)."""
        if vendor not in self.vendors:
            raise ValueError(f"unknown vendor {vendor!r}; the matrix has: {', '.join(self.vendors)}")
        return [c for c in self.cells if c.vendor == vendor and (runner is None or runner in c.runners)]

    def runner_labels(self, vendor: str) -> list[str]:
        spec = self.vendors[vendor]
        return [*spec["runners"], *spec.get("multi_gpu_runners", [])]


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
            multi = g.get("multi_gpu") and v.get("requires") is not None
            if multi and not v.get("multi_gpu_runners"):
                raise ValueError(f"group {group!r} needs several GPUs but vendor {vendor!r} has no multi_gpu_runners")
            runners = tuple(v["multi_gpu_runners"] if multi else v["runners"])
            cells.append(Cell(vendor, group, runners, v.get("requires"), int(g["budget_minutes"]),
                              g.get("markers"), g.get("command"), {k: str(x) for k, x in (g.get("env") or {}).items()}))
    return Matrix(data["vendors"], cells)
