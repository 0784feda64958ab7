#!/usr/bin/env python
"""Sweeps of training runs: plan, run (locally or as a Slurm job array), status, collect.

    outlier-titan-sweep plan SWEEP.toml [--out DIR] [--force]
    outlier-titan-sweep run DIR --local [--parallel K] [--nproc N]
    outlier-titan-sweep run DIR --slurm [--print-only] [--nodes N] [--gpus-per-node G] [--time T] ...
    outlier-titan-sweep status DIR
    outlier-titan-sweep collect DIR

The sweep file format is described in ``outlier_titan/study/spec.py``; the folder layout in
``outlier_titan/study/plan.py``; the results table's columns in ``outlier_titan/study/results.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from outlier_titan import cli
from outlier_titan.errors import UserError
from outlier_titan.plugins import take_plugins


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = take_plugins(argv)
    p = cli.parser(__doc__, plugins=True)
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", formatter_class=cli.HelpFormatter,
                        help="expand and validate a sweep file, write the sweep folder, print the table")
    pl.add_argument("sweep_file")
    pl.add_argument("--out", default=None, help="sweep folder (default outputs/sweeps/<sweep file stem>)")
    pl.add_argument("--force", action="store_true", help="re-plan a folder planned from a different file")
    r = sub.add_parser("run", formatter_class=cli.HelpFormatter,
                       help="run the unfinished points")
    r.add_argument("sweep_dir")
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true", help="run here, --parallel points at a time")
    mode.add_argument("--slurm", action="store_true", help="write (and submit with sbatch) a job-array script")
    r.add_argument("--parallel", type=int, default=None,
                   help="local: points at a time (default 1); slurm: max simultaneous array tasks (default all)")
    r.add_argument("--nproc", type=int, default=1, help="local: ranks per point (torchrun when > 1)")
    r.add_argument("--print-only", action="store_true", help="slurm: write and print the script, do not submit")
    for flag, kind in (("nodes", int), ("gpus-per-node", int), ("cpus-per-task", int), ("time", str),
                       ("partition", str), ("account", str), ("signal-seconds", int)):
        r.add_argument(f"--{flag}", type=kind, default=None, help="slurm: overrides the sweep file's [slurm]")
    t = sub.add_parser("task", formatter_class=cli.HelpFormatter,
                       help="run one point (what a Slurm array task executes)")
    t.add_argument("sweep_dir")
    t.add_argument("--index", type=int, required=True, help="the point's index in manifest.json")
    t.add_argument("--nproc", type=int, default=1, help="ranks per node")
    t.add_argument("--nnodes", type=int, default=1)
    t.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (several nodes)")
    t.add_argument("--rdzv-id", default=None)
    s = sub.add_parser("status", formatter_class=cli.HelpFormatter,
                       help="one line per point: done / running / failed / pending")
    s.add_argument("sweep_dir")
    c = sub.add_parser("collect", formatter_class=cli.HelpFormatter,
                       help="write results.csv / .md (/ .parquet) and print the markdown")
    c.add_argument("sweep_dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    args = parse(argv)
    return cli.report_user_errors(COMMANDS[args.command], args)


def cmd_plan(args) -> int:
    from outlier_titan.study.plan import plan_table, write_plan
    from outlier_titan.study.spec import load_sweep

    sweep = load_sweep(args.sweep_file)
    out = Path(args.out) if args.out else Path("outputs") / "sweeps" / Path(args.sweep_file).stem
    manifest, changes = write_plan(sweep, out, force=args.force)
    for line in changes:
        print(f"re-planned: {line}", file=sys.stderr)
    no_ckpt = [p.name for p in sweep.points if not p.cfg.checkpoint.enable]
    if no_ckpt:
        print(f"warning: checkpoint.enable is false for {len(no_ckpt)} point(s) (e.g. {no_ckpt[0]}): an interrupted "
              f"point restarts from step 0; set checkpoint.enable = true in [fixed] to resume", file=sys.stderr)
    print(plan_table(manifest))
    print(f"wrote {out / 'manifest.json'} and {len(manifest['points'])} point configs under {out / 'points'}",
          file=sys.stderr)
    return 0


def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise UserError(f"--{name} must be at least 1, got {v}")


def cmd_run(args) -> int:
    from outlier_titan.study.plan import read_manifest

    for name in ("parallel", "nproc", "nodes", "signal_seconds"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be >= 0 (0: a CPU job, one rank per node), got {args.gpus_per_node}")
    manifest = read_manifest(args.sweep_dir)
    if args.local:
        from outlier_titan.study.runner import run_points

        result = run_points(args.sweep_dir, manifest, parallel=args.parallel or 1, nproc=args.nproc)
        counts = {k: list(result.values()).count(k) for k in ("done", "failed", "pending")}
        print(f"sweep {args.sweep_dir}: {counts['done']} done, {counts['failed']} failed, "
              f"{counts['pending']} pending", file=sys.stderr)
        return 0 if counts["done"] == len(result) else 1
    return run_slurm(args, manifest)


def run_slurm(args, manifest) -> int:
    from outlier_titan.study.plan import point_dir
    from outlier_titan.study.runner import is_finished
    from outlier_titan.study.slurm import never_runs, slurm_script, submit

    sweep_dir = Path(args.sweep_dir)
    todo = [e["index"] for e in manifest["points"] if not is_finished(point_dir(sweep_dir, e["name"]), e)]
    if not todo:
        print(f"sweep {sweep_dir}: every point is done; nothing to submit", file=sys.stderr)
        return 0
    options = dict(manifest.get("slurm", {}))
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "time", "partition", "account", "signal_seconds"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    script = slurm_script(sweep_dir, todo, options, parallel=args.parallel or 0)
    (sweep_dir / "slurm").mkdir(exist_ok=True)
    path = sweep_dir / "slurm" / "sweep.sbatch"
    path.write_text(script)
    if args.print_only:
        print(script)
        print(f"wrote {path} ({len(todo)} array tasks); submit with: sbatch {path}", file=sys.stderr)
        return 0
    rc, output = submit(path)
    if rc == -1:
        print(script)
        print(f"wrote {path}; sbatch is not on PATH, submit it on the cluster with: sbatch {path}", file=sys.stderr)
        return 0
    print(output)
    if rc != 0:
        print(f"error: sbatch {path} failed (exit {rc})", file=sys.stderr)
        return 1
    reason = never_runs(output.split()[-1].split(";")[0])
    if reason:  # reported now, not left PENDING forever
        print(f"error: {reason}", file=sys.stderr)
        return 2
    return 0


def cmd_task(args) -> int:
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.runner import run_points

    manifest = read_manifest(args.sweep_dir)
    if not 0 <= args.index < len(manifest["points"]):
        raise UserError(f"--index {args.index} is out of range: the sweep has {len(manifest['points'])} points")
    primary = os.environ.get("SLURM_NODEID", "0") == "0"
    result = run_points(args.sweep_dir, manifest, [args.index], nproc=args.nproc, nnodes=args.nnodes,
                        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, primary=primary, progress=False)
    return 0 if set(result.values()) == {"done"} else 1


def cmd_status(args) -> int:
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.results import status_lines

    manifest = read_manifest(args.sweep_dir)
    print("\n".join(status_lines(Path(args.sweep_dir), manifest)))
    return 0


def cmd_collect(args) -> int:
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.results import collect, write_tables

    manifest = read_manifest(args.sweep_dir)
    columns, rows = collect(args.sweep_dir, manifest)
    written = write_tables(args.sweep_dir, columns, rows)
    print(written[1].read_text(), end="")
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return 0


COMMANDS = {"plan": cmd_plan, "run": cmd_run, "task": cmd_task, "status": cmd_status, "collect": cmd_collect}

if __name__ == "__main__":
    sys.exit(main())
