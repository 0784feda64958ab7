"""``python -m outlier_titan.tools.gpu_check`` (``scripts/gpu_check.sh``): runs the parts and writes their reports."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from outlier_titan.tools import gpu_check
from outlier_titan.tools.gpu_check.environment import environment
from outlier_titan.tools.gpu_check.plan import PART_BUDGET_S, PARTS, check_plan, named, plan
from outlier_titan.tools.gpu_check.report import markdown
from outlier_titan.tools.gpu_check.runner import run_items, run_tests
from outlier_titan.tools.gpu_check.worker import worker


def run_parts(parts: tuple[str, ...], dry: bool, out: Path, budget_s: float, command: str,
              tests: bool = True, items: dict[str, list[dict]] | None = None, only: tuple[str, ...] = ()
              ) -> list[dict]:
    """Runs the parts' items in one chain of workers (``budget_s`` per part) and writes each part's JSON and
    markdown; the log is ``gpu_check_part<N>.log`` (``all`` when every part runs, ``2-3-4`` for parts 2,3,4).
    ``only``: just the items whose name contains one of these strings."""
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + budget_s * len(parts)
    label = "all" if set(parts) == set(PARTS) else "-".join(parts)
    plans = {part: plan(part, dry) if items is None else items[part] for part in parts}
    if only:
        plans = {part: [it for it in chain if named(it, only)] for part, chain in plans.items()}
    with open(out / f"gpu_check_part{label}.log", "w") as log, tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        log.write(f"=== {command}\n")
        env = environment()
        print(f"torch {env['torch']}, CUDA {env['cuda']}, "
              f"{', '.join(d['name'] for d in env.get('devices', [])) or 'no CUDA device'}"
              f"{'; missing: ' + ', '.join(env['missing_modules']) if env['missing_modules'] else ''}", flush=True)
        reports = {part: {"part": part, "dry": dry, "command": command, "env": env, "tests": None, "items": [],
                          "plan_problems": check_plan(part) if dry else []} for part in parts}
        for part in parts:
            for problem in reports[part]["plan_problems"]:
                print(f"part {part}: the device plan does not build: {problem}", flush=True)
        if "1" in parts and tests:
            t = run_tests(out, log, limit_s=max(30.0, min(300.0, t_end - time.monotonic() - 120)))
            reports["1"]["tests"] = t
            print(f"pytest -m gpu: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped", flush=True)
        chain = [it for part in parts for it in plans[part]]
        rows = run_items(chain, dry, t_end, log, Path(tmp))
    for part in parts:
        report = reports[part]
        report["items"], rows = rows[:len(plans[part])], rows[len(plans[part]):]
        for it in report["items"]:
            print(f"part {part}: {it['name']}: {it['status']} ({it['seconds']:.1f} s)", flush=True)
        stem = out / f"gpu_check_part{part}"
        Path(f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        text = markdown(report)
        Path(f"{stem}.md").write_text(text)
        print(text, flush=True)
    return [reports[part] for part in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outlier_titan.tools.gpu_check", description=gpu_check.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="", help="1, 2, 3, 4, several comma-separated (2,3,4) or all")
    parser.add_argument("--dry", action="store_true", help="the same code paths on tiny shapes on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path.cwd() / "gpu_check_out"),
                        help="output folder (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--budget", type=float, default=PART_BUDGET_S, help="seconds per part")
    parser.add_argument("--no-tests", action="store_true", help="part 1 without the pytest run")
    parser.add_argument("--only", default="", help="comma-separated parts of item names: run just those items "
                        "(e.g. --only 'on pre_ln/kaul2024_gpt2_130m' for part 3's optimizer steps)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--events", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # it imports the built-ins for the items that need them
        return worker(Path(args.worker), args.start, Path(args.events), args.dry)
    import outlier_titan.components  # noqa: F401  (the built-ins, before the plan reads configs)
    parts = PARTS if args.part == "all" else tuple(p.strip() for p in args.part.split(","))
    if not parts or not all(p in PARTS for p in parts) or len(set(parts)) != len(parts):
        parser.error(f"--part {args.part!r}: use 1, 2, 3, 4, several of them comma-separated (e.g. 2,3,4) or all")
    command = "python -m outlier_titan.tools.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    failed = False
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    items = [it for part in parts for it in plan(part, args.dry)]
    if only and not any(named(it, only) for it in items):
        parser.error(f"--only {args.only!r} matches no item of part {args.part}; its items: "
                     f"{'; '.join(it['name'] for it in items)}")
    for report in run_parts(parts, args.dry, Path(args.out), args.budget, command, tests=not args.no_tests,
                            only=only):
        failed |= any(it["status"] != "ok" for it in report["items"]) or bool(report["plan_problems"])
        t = report["tests"]
        failed |= bool(t and (t["failures"] or t["errors"] or t["returncode"] not in (0, 5)))
    return 1 if failed else 0

