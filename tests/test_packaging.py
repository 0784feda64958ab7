"""A package, not a checkout: the shipped BPE and configs are package data found with importlib.resources, a
config argument takes a packaged name, the library starts package modules (never files under scripts/), and a
non-editable install into a fresh venv trains from another directory."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

import outlier_titan
from outlier_titan.config.manager import ConfigError, parse_args, to_toml
from outlier_titan.data.tokenizer import EMBEDDED_BPE, build_tokenizer, load_bpe_file
from outlier_titan.packaged import child_environment, configs_dir, packaged_config, packaged_config_names, resolve_config
from outlier_titan.study.suite_files import suite_file
from tests.launch import REPO

PACKAGE = Path(outlier_titan.__file__).parent


def test_shipped_tokenizer_is_package_data():
    resource = files("outlier_titan").joinpath("assets", "tokenizer", "stdlib_bpe.tiktoken")
    assert resource.is_file()
    assert Path(str(resource)) == EMBEDDED_BPE and EMBEDDED_BPE.is_relative_to(PACKAGE)
    tok = build_tokenizer("embedded")
    assert tok.fingerprint == load_bpe_file(EMBEDDED_BPE).fingerprint and tok.vocab_size == 4096
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_packaged_config_names_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no train_configs/ here: every name below is the packaged file
    debug = configs_dir() / "debug.toml"
    for name in ("debug", "debug.toml", "train_configs/debug.toml"):
        assert resolve_config(name) == debug, name
    assert packaged_config("suites/kaul2024/smoke") == configs_dir() / "suites" / "kaul2024" / "smoke.toml"
    for bad in ("../pyproject", "/debug.toml", "nope", "train_configs", ""):
        assert packaged_config(bad) is None, bad
    names = packaged_config_names()
    assert {"debug", "sweeps/debug_scaling", "suites/he2024/cpu"} <= set(names)
    assert to_toml(parse_args(["--config", "debug"])) == to_toml(parse_args(["--config", str(REPO / "train_configs" /
                                                                                           "debug.toml")]))
    with pytest.raises(ConfigError, match=r"^config file not found: nope \(pass an existing TOML file or a packaged"):
        parse_args(["--config", "nope"])
    # an existing file wins over the packaged name
    (tmp_path / "debug").write_text('[training]\nsteps = 7\n')
    assert parse_args(["--config", "debug"]).training.steps == 7


def test_the_papers_recipes_old_numbered_names_resolve_with_a_deprecation_note(tmp_path, monkeypatch, capsys):
    """seed000_* / seed001_* / seed002_* were renamed by paper (kaul2024_*, franke2025_*, he2024_*); the old names
    still work as a packaged name, a path and a sweep's base, each with one note on stderr."""
    from outlier_titan.study.spec import load_sweep

    monkeypatch.chdir(tmp_path)
    new = configs_dir() / "kaul2024_gpt2_130m_softmax1_orthoadam.toml"
    for old in ("seed000_gpt2_130m_softmax1_orthoadam", "train_configs/seed000_gpt2_130m_softmax1_orthoadam.toml",
                str(configs_dir() / "seed000_gpt2_130m_softmax1_orthoadam.toml")):
        assert resolve_config(old) == new, old
        assert capsys.readouterr().err == ("note: config seed000_gpt2_130m_softmax1_orthoadam.toml is now "
                                           "kaul2024_gpt2_130m_softmax1_orthoadam.toml; the old name is deprecated\n")
    assert resolve_config("seed002_op_soap") == configs_dir() / "he2024_op_soap.toml"
    assert resolve_config("seed001_angpt_125m") == configs_dir() / "franke2025_angpt_125m.toml"
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f'base = "{configs_dir()}/seed001_angpt_125m.toml"\nseeds = [0]\n')
    assert load_sweep(sweep).base == configs_dir() / "franke2025_angpt_125m.toml"


def test_checkout_configs_are_the_packaged_configs():
    """One copy of each file: the package's configs folder is the repository's train_configs/."""
    assert (PACKAGE / "configs").resolve() == (REPO / "train_configs").resolve() == configs_dir()
    assert suite_file("kaul2024", "smoke") == (REPO / "train_configs/suites/kaul2024/smoke.toml").resolve()


def test_child_processes_import_this_package_from_any_directory(tmp_path):
    """The processes a sweep or a reproduction starts import the package the parent imported (a worktree's code,
    not whatever else is installed), with the user's PYTHONPATH kept behind it."""
    env = child_environment({k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": "/x"})
    out = subprocess.run([sys.executable, "-c", "import outlier_titan, sys; print(outlier_titan.__file__)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve() == Path(outlier_titan.__file__).resolve()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(outlier_titan.__file__).resolve().parents[1]), "/x"]
    assert child_environment(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent


def test_library_starts_package_modules_not_scripts(tmp_path):
    from outlier_titan.study.runner import trainer_command
    from outlier_titan.study.slurm import slurm_script

    entry = {"name": "p0"}
    one = trainer_command(tmp_path, entry)
    assert one[:3] == [sys.executable, "-m", "outlier_titan.train"]
    two = trainer_command(tmp_path, entry, nproc=2)
    assert two[:3] == [sys.executable, "-m", "outlier_titan.launch"]
    assert two[two.index("-m", 3):][:2] == ["-m", "outlier_titan.train"]
    script = slurm_script(tmp_path, [0], {})
    assert "-m outlier_titan.tools.sweep task" in script
    for cmd in (one, two, [script]):
        assert not any("scripts/" in c or c.endswith("train.py") for c in cmd), cmd


def test_no_sys_path_patching():
    offenders = [str(p.relative_to(REPO)) for p in [*(REPO / "outlier_titan").rglob("*.py"),
                                                   *(REPO / "scripts").glob("*.py"), REPO / "train.py"]
                 if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert offenders == []


def _copy_source(dst: Path) -> None:
    """What ``pip install .`` reads from the checkout (the package, its configs link and target, metadata)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "outlier_titan", dst / "outlier_titan", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "train_configs", dst / "train_configs", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dst / name)


@pytest.mark.slow
def test_non_editable_install_trains_from_another_directory(tmp_path):
    src, venv, work = tmp_path / "src", tmp_path / "venv", tmp_path / "work"
    _copy_source(src)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    # torch and the other dependencies come from this interpreter's site-packages, and so does pip
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                           "--disable-pip-version-check", "-q", str(src)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.rmtree(src)  # nothing may be read from the source tree after the install
    site = subprocess.run([str(py), "-c", "import outlier_titan.data.tokenizer as t, outlier_titan.packaged as p; "
                           "print(t.__file__); print(t.EMBEDDED_BPE); print(p.configs_dir())"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert all(Path(s).is_relative_to(venv) for s in site), site  # the installed copy, not a checkout
    assert all(Path(s).exists() for s in site), site
    assert (venv / "bin" / "outlier-titan-sweep").is_file() and (venv / "bin" / "outlier-titan-train").is_file()

    proc = subprocess.run([str(py), "-m", "outlier_titan.train", "--config", "debug", "--training.steps", "2",
                           "--metrics.log_every", "1", "--checkpoint.enable", "false", "--observe.every", "0",
                           "--job.dump_folder", str(work / "out")], cwd=work, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished 2/2 steps" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (work / "out" / "debug" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) and 7.0 < v < 9.0 for v in losses.values()), losses

    proc = subprocess.run([str(venv / "bin" / "outlier-titan-reproduce"), "--help"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--suite" in proc.stdout, proc.stderr
