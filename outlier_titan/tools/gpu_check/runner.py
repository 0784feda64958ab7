"""The runner: the workers under per-item time limits and the part's budget, and the ``pytest -m gpu`` run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from outlier_titan.tools.gpu_check.environment import REPO


def _child_environment() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH: workers and pytest import the code that runs here."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def run_items(items: list[dict], dry: bool, deadline: float, log, tmp: Path, poll_s: float = 0.2) -> list[dict]:
    """Each item's record: status ok / error / timeout / crashed / skipped, seconds, result."""
    items_file = tmp / "items.json"
    items_file.write_text(json.dumps(items))
    records: list[dict | None] = [None] * len(items)
    start, launch = 0, 0
    while start < len(items):
        if time.monotonic() >= deadline:
            break
        launch += 1
        events = tmp / f"events-{launch}.jsonl"
        cmd = [sys.executable, "-m", "outlier_titan.tools.gpu_check", "--worker", str(items_file),
               "--start", str(start), "--events", str(events)] + (["--dry"] if dry else [])
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_environment(), cwd=REPO,
                                start_new_session=True)
        current, t_item, killed = None, time.monotonic(), None
        while True:
            rc = proc.poll()
            for e in _read_events(events):
                if e["event"] == "start" and records[e["index"]] is None and e["index"] != current:
                    current, t_item = e["index"], time.monotonic()
                elif e["event"] == "done" and records[e["index"]] is None:
                    records[e["index"]] = {k: e[k] for k in ("status", "seconds", "result")}
                    if current == e["index"]:
                        current = None
            if rc is not None:
                break
            now = time.monotonic()
            if current is not None and now - t_item > items[current]["limit_s"]:
                killed = f"ran past its {items[current]['limit_s']} s limit"
            elif now >= deadline:
                killed = "ran past the part's time budget"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(poll_s)
        if current is not None and records[current] is None:
            status = "timeout" if killed else "crashed"
            why = killed or f"the worker exited with code {proc.returncode} during this item"
            records[current] = {"status": status, "seconds": time.monotonic() - t_item, "result": {"error": why}}
            print(f"=== item {current}: {status}: {why}", file=log, flush=True)
        elif current is None and proc.returncode not in (0, None) and not killed:
            # the worker died before it started an item (e.g. an import error): that item is lost, go on
            first = next(i for i in range(start, len(items)) if records[i] is None)
            records[first] = {"status": "crashed", "seconds": 0.0,
                              "result": {"error": f"the worker exited with code {proc.returncode} before the item"}}
        nxt = next((i for i in range(len(items)) if records[i] is None), len(items))
        if nxt == start and not killed and nxt < len(items):  # the worker made no progress: give up on this item
            records[nxt] = {"status": "crashed", "seconds": 0.0,
                            "result": {"error": f"the worker exited with code {proc.returncode} without running it"}}
            nxt += 1
        start = nxt
    for i, r in enumerate(records):
        if r is None:
            records[i] = {"status": "skipped", "seconds": 0.0,
                          "result": {"error": "not started: the part's time budget was spent"}}
    return [{"name": it["name"], "kind": it["kind"], "item": it, **r} for it, r in zip(items, records)]


def run_tests(out: Path, log, limit_s: float) -> dict:
    """``pytest -m gpu`` on the tests/test_gpu*.py files; counts from the junit XML."""
    import xml.etree.ElementTree as ET

    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_gpu*.py"))
    xml = out / "pytest_gpu.xml"
    xml.unlink(missing_ok=True)  # no counts from an earlier run
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}",
           *files]
    t0 = time.monotonic()
    log.write(f"=== {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_child_environment(),
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:  # pytest and the train.py runs it started: none may hold the GPU after
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
        log.write(f"=== pytest ran past its {limit_s:.0f} s limit and was killed\n")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.is_file():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            counts = {k: int(suite.get(k, 0)) for k in counts}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"command": "python -m pytest -m gpu " + " ".join(files), "returncode": rc,
            "seconds": time.monotonic() - t0, **counts}

