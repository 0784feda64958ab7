"""The evaluation of a suite's finished points: ``scripts/evaluate.py`` on each final checkpoint that lacks its
report, with each scale's evaluation settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from outlier_titan.study.plan import point_dir
from outlier_titan.study.suite_files import SCALES
from outlier_titan.study.suites.base import SuiteInfo

# scripts/evaluate.py settings per scale: validation tokens, sequences per pass, calibration batches and seeds
EVAL_ARGS = {"smoke": dict(tokens=512, batch_size=4, calib_batches=1, calib_seeds=1),
             # 16 calibration batches (16k tokens): at 4, a W8A8 point's three calibration seeds spread 77-225 PPL
             "cpu": dict(tokens=65536, batch_size=8, calib_batches=16, calib_seeds=3),
             "gpu": dict(tokens=1_048_576, batch_size=16, calib_batches=4, calib_seeds=3)}
EVAL_ARGS |= {scale: EVAL_ARGS["cpu"] for scale in SCALES if scale not in EVAL_ARGS}  # every other scale: as cpu


def evaluate_points(sweep_dir: Path, manifest: dict[str, Any], info: SuiteInfo, scale: str,
                    parallel: int = 1) -> list[str]:
    """Runs ``scripts/evaluate.py`` on the final checkpoint of every finished point without its report, ``parallel``
    at a time (the CPU threads shared out as for the sweep's trainers), with a progress bar on stderr; returns the
    names of points whose evaluation failed (their log is ``<point>/eval.log``)."""
    import time

    from outlier_titan.study.runner import is_finished, point_bar, point_line, read_state, trainer_environment

    a = EVAL_ARGS[scale]
    todo = []
    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        if not is_finished(folder, e) or is_evaluated(folder / "eval" / f"step-{e['steps']}.json", info.all_schemes):
            continue
        if read_state(folder).get("adopted_from"):  # no checkpoint here: its evaluation is the adopted one
            continue
        todo.append((e["name"], folder, [
            sys.executable, "-m", "outlier_titan.tools.evaluate", "--checkpoint",
            str(folder / "checkpoints" / f"step-{e['steps']}"), "--device", "cpu" if scale != "gpu" else "auto",
            "--schemes", ",".join(info.all_schemes), "--tokens", str(a["tokens"]), "--batch-size",
            str(a["batch_size"]), "--calib-batches", str(a["calib_batches"]), "--calib-seeds", str(a["calib_seeds"])]))
    env = trainer_environment(min(parallel, max(1, len(todo))), 1)
    failed, running = set(), []
    bar = point_bar("evaluate", len(todo), enabled=bool(todo))

    def show_running() -> None:
        bar.set_postfix_str(f"running {', '.join(r[0] for r in running)}" if running else "")

    try:
        while todo or running:
            while todo and len(running) < parallel:
                name, folder, cmd = todo.pop(0)
                log = (folder / "eval.log").open("w")
                running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, env=env), log))
                show_running()
            time.sleep(0.2)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                item[2].close()
                bar.update(1)
                if item[1].returncode != 0:
                    failed.add(item[0])
                    point_line(bar, "failed", item[0], f"see {item[2].name}")
                else:
                    point_line(bar, "done", item[0])
                show_running()
    finally:  # Ctrl-C: the evaluations in flight end with this process
        bar.close()
        for _, proc, log in running:
            proc.terminate()
            proc.wait()
            log.close()
    return [e["name"] for e in manifest["points"] if e["name"] in failed]



def is_evaluated(report: Path, schemes: tuple[str, ...]) -> bool:
    """Whether an evaluation report exists and covers every scheme (one from an older suite file that lacked some
    is run again, whole: its numbers then come from one evaluation)."""
    if not report.is_file():
        return False
    try:
        done = {e.get("scheme") for e in json.loads(report.read_text()).get("schemes", [])}
    except (json.JSONDecodeError, AttributeError):
        return False
    return set(schemes) <= done


def eval_report(folder: Path, steps: int) -> dict[str, Any] | None:
    """A point's evaluation report of its final step, or None."""
    path = folder / "eval" / f"step-{steps}.json"
    return json.loads(path.read_text()) if path.is_file() else None

