#!/usr/bin/env python
"""Reproduce a paper's phenomena: run its suite (a sweep), evaluate every final checkpoint, write the report.

    outlier-titan-reproduce --suite SUITE --scale {smoke|cpu|gpu} [--out DIR]
    outlier-titan-reproduce --suite kaul2024 --scale search --parallel 2  # the cpu scale's calibration search
    outlier-titan-reproduce --suite kaul2024 --scale synthetic --parallel 2  # on the Bigram-Backcopy task
    outlier-titan-reproduce --suite kaul2024 --scale cpu --slurm [--slurm-args "--partition gpu ..."]
    outlier-titan-reproduce --suite kaul2024 --scale cpu --report-only    # after the Slurm array finished
    outlier-titan-reproduce --suite he2024 --scale gpu --dry-run          # the papers' runs on 1 and 8 GPUs
    outlier-titan-reproduce --suite he2024 --scale cpu --adopt reports/he2024-cpu  # go on from another machine's part
    outlier-titan-reproduce --suite he2024 --scale tiles --adopt reports/he2024-tuned  # take the points they share
    outlier-titan-reproduce --suite franke2025 --scale lr --only 'angpt_*'  # train these points, report the finished

The suites are sweep files under ``train_configs/suites/<suite>/<scale>.toml`` (each suite's scales are listed
below; what each scale is: ``outlier_titan/study/suite_files.py``); the run folders go to
``--sweep-dir`` (default ``outputs/reproduce/<suite>-<scale>``), the report (``report.md``, ``figures/``,
``results.csv``, ``runs/<point>/`` logs) to ``--out`` (default ``reports/<suite>-<scale>``). Running again skips
finished points and evaluations. ``--adopt DIR`` takes over the finished, evaluated points of a report folder
written by an earlier run (on any machine, e.g. committed after a part of the suite ran, or another suite's report
that ran the same configs), so a suite can be run in parts; each adopted point's config is checked against the
suite's. ``--only PATTERN`` (repeatable, shell-style on point names) trains only the matching points, so a part that
fits the time left ends evaluated and reported. ``--report-only --adopt reports/X --out reports/X`` re-renders a
committed report from its own runs (as they were evaluated) with the current report code, and refuses before writing
anything if a point would be lost.
See ``outlier_titan/study/reproduce.py``.
"""

from __future__ import annotations

import argparse
import fnmatch
import shlex
import subprocess
import sys
from pathlib import Path

from outlier_titan import cli
from outlier_titan.errors import UserError
from outlier_titan.packaged import child_environment
from outlier_titan.plugins import PLUGINS_HELP, take_plugins
from outlier_titan.study.suite_files import SCALES
from outlier_titan.study.suites import SUITE_NAMES


def _scales_table() -> str:
    """The scales each suite has, read from its sweep files (so --help never lists a scale that is not there)."""
    from outlier_titan.study.suite_files import suite_scales
    width = max(map(len, SUITE_NAMES))
    return "\nScales each suite has:\n" + "".join(
        f"  {name:<{width}}  {', '.join(suite_scales(name))}\n" for name in SUITE_NAMES)


def only_indices(manifest: dict, patterns: list[str]) -> list[int]:
    """The indices of the planned points whose name matches one of ``patterns`` (``--only``); a pattern that
    matches no point is a UserError naming the points."""
    names = [e["name"] for e in manifest["points"]]
    chosen: set[int] = set()
    for pat in patterns:
        matched = {i for i, name in enumerate(names) if fnmatch.fnmatchcase(name, pat)}
        if not matched:
            raise UserError(f"--only {pat!r} matches none of the suite's points; they are: {', '.join(names)}")
        chosen |= matched
    return sorted(chosen)


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = take_plugins(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__ + _scales_table(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plugins", metavar="A,B", help=PLUGINS_HELP)
    p.add_argument("--suite", required=True, choices=SUITE_NAMES)
    p.add_argument("--scale", required=True, choices=SCALES)
    p.add_argument("--out", default=None, help="report folder (default reports/<suite>-<scale>)")
    p.add_argument("--sweep-dir", default=None, help="run folders (default outputs/reproduce/<suite>-<scale>)")
    p.add_argument("--parallel", type=int, default=1, help="local: points trained, then evaluated, at a time")
    p.add_argument("--slurm", action="store_true", help="submit the unfinished points as a Slurm job array")
    p.add_argument("--slurm-args", default="",
                   help="extra flags of 'sweep.py run --slurm', one quoted string, e.g. --slurm-args=\"--print-only\"")
    p.add_argument("--force", action="store_true",
                   help="re-plan a sweep folder planned from an older suite file (changed points move to replaced/)")
    p.add_argument("--report-only", action="store_true", help="do not train; evaluate, collect and report")
    p.add_argument("--adopt", action="append", default=[], metavar="REPORT_DIR",
                   help="take over the finished, evaluated points of this report folder (an earlier run of the "
                        "suite, e.g. on another machine, or a suite sharing points) instead of training them "
                        "again; repeatable")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="train only the points whose name matches this shell-style pattern (e.g. 'angpt_*'; "
                        "repeatable), then evaluate and report every finished point; --dry-run lists the names")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only: the points (gpu scale: per-GPU memory and time on 1 and 8 GPUs)")
    p.add_argument("--tokenizer", default=None, help="gpu --dry-run: plan with this data.tokenizer (offline)")
    p.add_argument("--mfu", type=float, default=0.4, help="gpu --dry-run: assumed model FLOPs utilisation")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="gpu --dry-run: bf16 dense peak per GPU (989: H100/H200 SXM)")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="gpu --dry-run: memory per GPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    args = parse(argv)
    return cli.report_user_errors(run, args)


def run(args: argparse.Namespace) -> int:
    from outlier_titan.study.plan import plan_table, read_manifest, write_plan
    from outlier_titan.study.gpu_plan import gpu_dry_run
    from outlier_titan.study.reproduce import build_report
    from outlier_titan.study.suite_files import suite_file, suite_sweep

    if args.parallel < 1:
        raise UserError(f"--parallel must be at least 1, got {args.parallel}")
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], got {args.mfu}")
    tag = f"{args.suite}-{args.scale}"
    suite_file(args.suite, args.scale)  # a bad --suite / --scale is a one-line error before anything else
    if args.dry_run:
        if args.scale == "gpu":
            print(gpu_dry_run(args.suite, args.tokenizer, args.mfu, args.peak_tflops, args.gpu_gib))
        else:
            from outlier_titan.study.plan import build_manifest

            print(plan_table(build_manifest(suite_sweep(args.suite, args.scale), Path("/nonexistent"))))
        return 0
    if args.tokenizer:
        raise UserError("--tokenizer applies to --scale gpu --dry-run only")
    sweep_dir = Path(args.sweep_dir or Path("outputs") / "reproduce" / tag)
    out = Path(args.out or Path("reports") / tag)
    for src in args.adopt:
        if not Path(src).is_dir():
            raise UserError(f"--adopt {src}: no such folder; name a report folder written by scripts/reproduce.py "
                            f"(e.g. reports/{tag})")
    if args.only and (args.report_only or args.slurm):
        raise UserError("--only chooses the points to train here; it does not apply with --report-only or --slurm")
    if not args.report_only or args.adopt:
        manifest, _ = write_plan(suite_sweep(args.suite, args.scale), sweep_dir, force=args.force)
        print(plan_table(manifest), file=sys.stderr)
    indices = only_indices(manifest, args.only) if args.only else None
    if args.adopt:
        from outlier_titan.study.adopt import adopt_points
        from outlier_titan.study.suites import SUITE_INFO

        for src in args.adopt:
            # --report-only --adopt R --out R re-renders R from its own runs, as they were evaluated
            in_place = args.report_only and Path(src).resolve() == out.resolve()
            adopted, refused = adopt_points(sweep_dir, manifest, Path(src), SUITE_INFO[args.suite].all_schemes,
                                            args.scale, as_evaluated=in_place)
            print(f"adopted {len(adopted)} finished point(s) from {src}"
                  + (f": {', '.join(adopted)}" if adopted else ""), file=sys.stderr)
            for line in refused:
                print(f"not adopted: {line}", file=sys.stderr)
            if in_place and refused:
                raise UserError(f"re-rendering {out} in place would drop {len(refused)} of its points (above: their "
                                f"configs differ from the suite file's or their runs did not finish); the report "
                                f"is left as it was")
    if not args.report_only:
        if args.slurm:
            cmd = [sys.executable, "-m", "outlier_titan.tools.sweep", "run", str(sweep_dir), "--slurm",
                   *shlex.split(args.slurm_args)]
            rc = subprocess.call(cmd, env=child_environment())
            print(f"when the array has finished: outlier-titan-reproduce --suite {args.suite} --scale "
                  f"{args.scale} --sweep-dir {sweep_dir} --out {out} --report-only", file=sys.stderr)
            return rc
        from outlier_titan.study.runner import run_points

        result = run_points(sweep_dir, manifest, indices, parallel=args.parallel)
        n_done = list(result.values()).count("done")
        print(f"sweep {sweep_dir}: {n_done} of {len(result)} points done", file=sys.stderr)
        pending = list(result.values()).count("pending")
        if pending:  # stopped (a signal): evaluating and reporting now would only delay the stop
            print(f"stopped with {pending} point(s) unfinished: no evaluation or report; the same command resumes",
                  file=sys.stderr)
            return 1
    elif not args.adopt:
        read_manifest(sweep_dir)
    report = build_report(args.suite, args.scale, sweep_dir, out, args.parallel)
    print(report.read_text())
    print(f"wrote {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
