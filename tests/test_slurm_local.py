"""``scripts/slurm_local.sh`` itself: the two-node cluster starts on a machine where no cluster ever ran (fresh
folders; Slurm installed with apt-get when missing) and ``stop`` leaves no daemon of its own. It runs beside the
clusters CI started (another node network prefix, subnet and ports), so it never touches them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SCRIPT = str(REPO / "scripts" / "slurm_local.sh")


def munged_pids() -> set[int]:
    """The live munged processes (a zombie has exited)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "munged" \
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.add(int(proc.name))
        except OSError:
            pass
    return pids


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline and int(proc.name) != os.getpid():
            found.append(cmdline)
    return found


def test_two_nodes_start_from_fresh_folders_and_stop_leaves_nothing_running(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("scripts/slurm_local.sh start --nodes 2 needs root")
    nodes_dir = tmp_path / "nodes"
    env = {**os.environ, "SLURM_LOCAL_DIR": str(tmp_path / "one"), "SLURM_LOCAL_NODES_DIR": str(nodes_dir),
           "SLURM_LOCAL_NODES_PREFIX": "otf", "SLURM_LOCAL_NODES_SUBNET": "10.78.0",
           "SLURM_LOCAL_NODES_CTLD_PORT": "6847", "SLURM_LOCAL_NODES_SLURMD_PORT": "6848"}
    munged_before = munged_pids()
    try:
        start = subprocess.run([SCRIPT, "start", "--nodes", "2"], capture_output=True, text=True, env=env,
                               timeout=600)
        if "not permitted here" in start.stderr:
            pytest.skip(start.stderr.strip())
        assert start.returncode == 0, start.stdout + start.stderr
        assert "local Slurm up: nodes node1..node2 idle" in start.stdout, start.stdout
        job = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "hostname"], capture_output=True,
                             text=True, env={**env, "SLURM_CONF": str(nodes_dir / "slurm.conf")}, timeout=120)
        assert job.returncode == 0 and sorted(job.stdout.split()) == ["node1", "node2"], job.stdout + job.stderr
    finally:
        stop = subprocess.run([SCRIPT, "stop"], capture_output=True, text=True, env=env, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert processes_mentioning(str(nodes_dir)) == []
    assert "otfnode" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", "otfbr0"], capture_output=True).returncode != 0
    assert munged_pids() <= munged_before  # a munged that start started is stopped; one that ran before stays
