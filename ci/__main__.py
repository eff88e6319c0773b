"""python -m resin.ci run --vendor cpu|cuda|rocm [--runner LABEL] [--groups a,b] [-- PYTEST_ARGS]
python -m resin.ci workflow [--write | --check]
python -m resin.ci kernels [--targets gfx942,gfx950,sm_90,sm_100] [--shapes S,..] [--all] [--json PATH] [--jobs N]"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from resin.ci.matrix import Cell, load_matrix
from resin.ci.workflow import WORKFLOW_FILE, render


def run_cell(cell: Cell, present: str, extra_pytest_args: list[str] = ()) -> tuple[str, float]:
    """Run one cell; extra_pytest_args narrow a pytest cell (`-k NAME` reruns one failing test in the cell's own
    markers and environment)."""
    if cell.requires is not None and cell.requires != present:
        return f"skipped: requires {cell.requires} GPU", 0.0
    cmd = ([sys.executable, "-m", "pytest", *cell.pytest_args(), *extra_pytest_args] if cell.markers
           else shlex.split(cell.command))
    env = {**os.environ, **cell.env, "RESIN_TEST_BACKEND": cell.vendor}
    start = time.monotonic()
    try:
        rc = subprocess.run(cmd, env=env, timeout=cell.budget_minutes * 60).returncode
    except subprocess.TimeoutExpired:
        return f"FAILED: over its {cell.budget_minutes}-minute budget", time.monotonic() - start
    status = {0: "passed", 5: "no tests selected"}.get(rc, f"FAILED (exit {rc})")
    return status, time.monotonic() - start


def cmd_run(args: argparse.Namespace) -> int:
    from resin.hal import detect_kind

    matrix = load_matrix()
    runner = args.runner or matrix.vendors[args.vendor]["runners"][0]
    if runner not in matrix.runner_labels(args.vendor):
        raise SystemExit(f"vendor {args.vendor} has no runner {runner!r}; its runners: "
                         f"{', '.join(matrix.runner_labels(args.vendor))}")
    cells = matrix.column(args.vendor, runner)
    if args.groups:
        wanted = set(args.groups.split(","))
        cells = [c for c in cells if c.group in wanted]
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if extra and any(not c.markers for c in cells):
        raise ValueError(f"pytest arguments ({shlex.join(extra)}) only apply to pytest groups; "
                         f"pick those with --groups")
    present = detect_kind()
    rows = [(c.group, *run_cell(c, present, extra)) for c in cells]
    print(f"\nvendor {args.vendor}, runner {runner}, this machine: {present}")
    width = max(len(r[0]) for r in rows)
    for group, status, seconds in rows:
        print(f"  {group:<{width}}  {status:<40} {seconds:7.1f}s")
    return 1 if any(r[1].startswith("FAILED") for r in rows) else 0


def cmd_workflow(args: argparse.Namespace) -> int:
    text = render()
    if args.write:
        WORKFLOW_FILE.parent.mkdir(parents=True, exist_ok=True)
        WORKFLOW_FILE.write_text(text)
        print(f"wrote {WORKFLOW_FILE}")
    elif args.check:
        current = Path(WORKFLOW_FILE).read_text() if WORKFLOW_FILE.exists() else ""
        if current != text:
            print(f"{WORKFLOW_FILE} is stale: run python -m resin.ci workflow --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    from resin.ci.kernel_gate import run_gate, write_json

    start = time.monotonic()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes else None
    report = run_gate([t.strip() for t in args.targets.split(",") if t.strip()], args.jobs, shapes)
    print(report.format(every_specialisation=args.all))
    if args.json:
        write_json(report, args.json)
    problems = report.problems()
    total = sum(len(rows) for rows in report.results.values())
    print(f"\n{total} specialisations compiled for {', '.join(report.results)} in {time.monotonic() - start:.0f} s; "
          f"{len(problems)} problem(s)")
    for line in problems:
        print(f"  FAIL {line}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resin.ci", description="The per-vendor CI matrix.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run one vendor column and print a summary table")
    p.add_argument("--vendor", required=True)
    p.add_argument("--runner", default=None, help="the runner label, for the summary (default: the first)")
    p.add_argument("--groups", default=None, help="only these groups, comma-separated")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="after --: passed to pytest in each selected group, e.g. -- -k test_fused_moe")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("workflow", help="print, --write or --check .github/workflows/ci.yml")
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.set_defaults(func=cmd_workflow)
    p = sub.add_parser("kernels", help="compile every Triton kernel the engine launches for GPU targets (no GPU "
                                       "needed); fail on compile errors, spills, or shared memory over the limit")
    p.add_argument("--targets", default="gfx942,gfx950,sm_90,sm_100")
    p.add_argument("--all", action="store_true", help="a row per specialisation, not only per kernel")
    p.add_argument("--json", default=None, help="also write every result to this file")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    p.add_argument("--shapes", default=None, help="only the model/attention shapes whose name contains one of "
                                                  "these, comma-separated (default: all; see ci/kernel_shapes.py)")
    p.set_defaults(func=cmd_kernels)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
