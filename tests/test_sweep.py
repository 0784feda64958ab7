"""Sweeps: sweep-file validation, plan, run --local (failing point, kill -9 and resume), status, collect,
TensorBoard hparams, and run --slurm through a fake sbatch that runs the array tasks here."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.launch import REPO
from outlier_titan.provenance import code_version

BASE = REPO / "train_configs" / "debug.toml"
TINY = """
[fixed]
model.n_layers = 1
model.n_heads = 2
training.steps = 6
training.seq_len = 32
training.global_batch_size = 4
lr_scheduler.warmup_steps = 2
checkpoint.interval = 3
metrics.log_every = 1
eval.every = 3
eval.steps = 1
observe.every = 3
observe.mode = "cheap"
"""
# Three points, the last one fails in the trainer (its data file does not exist; the plan cannot know).
THREE = f"""
base = "{BASE}"
name = "d{{model.dim}}_{{index}}"
{TINY}
[[zip]]
model.dim = [16, 32, 16]
data.source = ["embedded", "embedded", "missing.txt"]
"""


def write(tmp: Path, text: str, name: str = "sweep.toml") -> Path:
    path = tmp / name
    path.write_text(textwrap.dedent(text))
    return path


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


TIMING_COLUMNS = {"wall_s", "tokens_per_s"}


def assert_same_values(rows: list[dict], ref: list[dict]) -> None:
    """Row by row, every column but the timings equal: numbers to 1e-6 (relative), text exactly."""
    for a, b in zip(rows, ref):
        for col in set(a) - TIMING_COLUMNS:
            try:
                assert float(a[col]) == pytest.approx(float(b[col]), rel=1e-6), col
            except ValueError:
                assert a[col] == b[col], col


# ------------------------------------------------------------------------------------------ validation

BAD_FILES = {
    "unknown_top_key": ("bogus = 1\n", "unknown key 'bogus'"),
    "unknown_config_key": ("[grid]\nmodel.dimm = [16, 32]\n", "point 0 (model.dimm=16): unknown key 'model.dimm'"),
    "wrong_type": ("[grid]\nmodel.dim = ['wide']\n", "model.dim: expected int"),
    "wrong_type_seeds": ("seeds = [0.5]\n", "'seeds' must be a list of integers"),
    "empty_axis": ("[grid]\nmodel.dim = []\n", "axis 'model.dim' is empty"),
    "duplicate_names": ("name = 'same'\n[grid]\nmodel.dim = [16, 32]\n", "duplicate point name 'same'"),
    "bad_value": ("[grid]\noptimizer.lr = [1e-3, -1.0]\n", "point 1 (optimizer.lr=-1.0): optimizer.lr must be > 0"),
    "bad_model_shape": ("[grid]\nmodel.n_heads = [3]\n", "dim 128 is not divisible by n_heads 3"),
    "zip_lengths": ("[zip]\nmodel.dim = [16, 32]\noptimizer.lr = [1e-3]\n", "zipped axes must have equal lengths"),
    "axis_and_fixed": ("[fixed]\nmodel.dim = 16\n[grid]\nmodel.dim = [16, 32]\n", "set in [fixed] and again"),
}


def scripts_main():
    """``scripts/sweep.py``'s main (``outlier_titan.tools.sweep``), for in-process calls (no interpreter start-up)."""
    from outlier_titan.tools import sweep as sweep_cli

    return sweep_cli.main


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_sweep_file_is_one_line_exit_2(tmp_path, capsys, case):
    body, expected = BAD_FILES[case]
    path = write(tmp_path, f'base = "{BASE}"\n' + body)
    rc = scripts_main()(["plan", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "out").exists()


def test_plan_cli_error_exit_code(tmp_path):
    path = write(tmp_path, f'base = "{BASE}"\n[grid]\ntraining.stepz = [1]\n')
    proc = cli("plan", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "did you mean 'training.steps'" in proc.stderr


def test_fixed_from_takes_the_base_and_fixed_of_another_sweep_file(tmp_path):
    """A search or re-run states only what it changes: its own [fixed] overrides the inherited keys, an axis here
    drops the inherited fixed value, and a chain of files is read root first; nothing but base and [fixed] is
    inherited."""
    from outlier_titan.study.spec import load_sweep

    write(tmp_path, f'base = "{BASE}"\nseeds = [0, 1]\n{TINY}optimizer.lr = 1e-2\nmodel.dim = 16\n', "recipe.toml")
    write(tmp_path, 'fixed_from = "recipe.toml"\n[fixed]\ntraining.steps = 4\n', "middle.toml")
    leaf = write(tmp_path, 'fixed_from = "middle.toml"\n[fixed]\nmodel.n_heads = 4\n'
                           '[grid]\noptimizer.lr = [1e-3, 3e-3]\n')
    sweep = load_sweep(leaf)
    assert sweep.base == BASE.resolve() and [p.name for p in sweep.points] == ["lr0.001", "lr0.003"]  # no seeds axis
    for p, lr in zip(sweep.points, (1e-3, 3e-3)):
        cfg = p.cfg
        assert (cfg.optimizer.lr, cfg.training.steps, cfg.model.n_heads, cfg.model.dim) == (lr, 4, 4, 16)
        assert (cfg.model.n_layers, cfg.eval.every, cfg.observe.mode) == (1, 3, "cheap")  # from recipe.toml


@pytest.mark.parametrize("body,expected", [
    ('fixed_from = "nowhere.toml"\n', "fixed_from 'nowhere.toml' not found"),
    ('fixed_from = "sweep.toml"\n', "leads back to a file already read"),
    ('fixed_from = 3\n', "'fixed_from' must be a string"),
    ('fixed_from = "other.toml"\n', "leads back to a file already read")])
def test_a_bad_fixed_from_is_one_line(tmp_path, body, expected):
    from outlier_titan.study.spec import SweepError, load_sweep

    write(tmp_path, 'fixed_from = "sweep.toml"\n', "other.toml")
    with pytest.raises(SweepError, match=expected) as e:
        load_sweep(write(tmp_path, body))
    assert len(str(e.value).splitlines()) == 1


def test_the_suite_files_that_inherit_their_recipe_plan():
    """The suite files that state only what they change (``fixed_from``) still plan, from their own folder."""
    from outlier_titan.study.spec import load_sweep

    inheriting = [f for f in (REPO / "train_configs" / "suites").glob("*/*.toml") if "fixed_from" in f.read_text()]
    assert len(inheriting) >= 9
    for f in inheriting:
        assert load_sweep(f).points, f


# ------------------------------------------------------------------------------------------ plan

@pytest.mark.slow
def test_plan_table_budget_and_replan(tmp_path):
    from outlier_titan.config.manager import parse_args
    from outlier_titan.models.registry import build_meta_model, count_params

    text = f"""
    base = "{BASE}"
    name = "d{{model.dim}}_k{{tokens_per_param}}_s{{seed}}"
    seeds = [0, 1]
    budget_params = "non_embedding"
    {TINY.replace("training.steps = 6", "")}
    [grid]
    model.dim = [16, 32]
    tokens_per_param = [0.5, 1]
    """
    path = write(tmp_path, text)
    proc = cli("plan", str(path), "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["axes"] == ["model.dim", "tokens_per_param", "seed"]
    names = [p["name"] for p in manifest["points"]]
    assert len(names) == 8 and len(set(names)) == 8 and "d32_k0.5_s1" in names
    for p in manifest["points"]:
        assert p["name"] in proc.stdout
        cfg = parse_args(["--config", str(tmp_path / "out" / "points" / p["name"] / "config.toml")])
        assert cfg.model.dim == p["axes"]["model.dim"] and cfg.training.seed == p["axes"]["seed"]
        _, _, model = build_meta_model(cfg.model, 4096, cfg.training.seq_len)
        assert p["params"] == count_params(model)
        non_emb = count_params(model, exclude_embeddings=True)
        tokens_per_step = 4 * 32
        assert cfg.training.steps == max(1, round(p["axes"]["tokens_per_param"] * non_emb / tokens_per_step))
        assert p["tokens"] == cfg.training.steps * tokens_per_step
        assert p["flops"] == pytest.approx(p["flops_per_token"] * p["tokens"])
    # a changed file: refused with what changed, nothing touched; --force re-plans
    path.write_text(path.read_text().replace("[grid]", "[grid]\noptimizer.lr = [1e-3]"))
    before = (tmp_path / "out" / "manifest.json").read_text()
    proc = cli("plan", str(path), "--out", "out", cwd=tmp_path)
    assert proc.returncode == 2
    assert "changed point d16_k0.5_s0: optimizer.lr: 0.003 -> 0.001" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "out" / "manifest.json").read_text() == before
    proc = cli("plan", str(path), "--out", "out", "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name.rsplit("-", 2)[0] for p in (tmp_path / "out" / "replaced").iterdir()) == sorted(names)


def test_a_replan_keeps_the_config_a_finished_point_recorded(tmp_path):
    """Re-planning a folder (a resumed sweep, a report re-rendered from its runs) rewrites the config of a point
    still to run, never that of a finished one: its config.toml is the record of what trained it."""
    from outlier_titan.study.plan import point_dir, write_plan
    from outlier_titan.study.runner import write_state
    from outlier_titan.study.spec import load_sweep

    sweep = load_sweep(write(tmp_path, THREE))
    manifest, _ = write_plan(sweep, tmp_path / "out")
    done, todo = (point_dir(tmp_path / "out", e["name"]) for e in manifest["points"][:2])
    recorded = (done / "config.toml").read_text().replace("[job]", "# as the run wrote it\n[job]")
    (done / "config.toml").write_text(recorded)
    write_state(done, {"status": "done"})
    (todo / "config.toml").write_text("# left by an older plan\n")
    write_plan(sweep, tmp_path / "out")
    assert (done / "config.toml").read_text() == recorded
    assert (todo / "config.toml").read_text() == manifest["points"][1]["config"]


# ------------------------------------------------------------------------------------------ run --local

@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    path = write(tmp, THREE)
    assert cli("plan", str(path), "--out", "out", cwd=tmp).returncode == 0
    t0 = time.time()
    run = cli("run", "out", "--local", "--parallel", "2", cwd=tmp)
    return tmp, path, run, time.time() - t0


def test_trainers_share_the_cpus_unless_omp_num_threads_is_set():
    from outlier_titan.study.runner import trainer_environment

    cpus = len(os.sched_getaffinity(0))
    env = trainer_environment(2, 1, {"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == str(max(1, cpus // 2)) and env["PATH"] == "/bin"
    assert trainer_environment(1, 1, {})["OMP_NUM_THREADS"] == str(cpus)
    assert trainer_environment(3, 64 * cpus, {})["OMP_NUM_THREADS"] == "1"
    assert trainer_environment(2, 2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


@pytest.mark.slow
def test_run_local_with_a_failing_point(local_sweep):
    tmp, _, run, _ = local_sweep
    out = tmp / "out"
    assert run.returncode == 1, run.stderr
    assert "1 failed" in run.stderr and "2 done" in run.stderr
    status = cli("status", "out", cwd=tmp)
    lines = status.stdout.splitlines()
    assert lines[1].split()[:3] == ["d16_0", "done", "6/6"]
    assert lines[2].split()[:3] == ["d32_1", "done", "6/6"]
    assert lines[3].split()[:3] == ["d16_2", "failed", "0/6"] and "error: data.source" in lines[3]
    state = json.loads((out / "points" / "d16_2" / "sweep_state.json").read_text())
    assert state["status"] == "failed" and state["returncode"] == 2
    assert state["error"].startswith("error: data.source: path missing.txt does not exist")
    # plan numbers are the trainer's own: compare with its console line
    manifest = json.loads((out / "manifest.json").read_text())
    for p in manifest["points"][:2]:
        log = (out / "points" / p["name"] / "train.log").read_text()
        assert f"{p['params'] / 1e6:.2f}M params, {p['flops_per_token'] / 1e6:.1f} MFLOP/token" in log
        state = json.loads((out / "points" / p["name"] / "sweep_state.json").read_text())
        assert state["pid"] != os.getpid()
        # the code that ran the attempt (one attempt, one version; "+dirty" may differ if files change meanwhile)
        assert [c.split("+")[0] for c in state["code"]] == [code_version().split("+")[0]]


@pytest.mark.slow
def test_collect_table_and_tensorboard_hparams(local_sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from outlier_titan.observe.logger import read_metrics

    tmp, _, _, _ = local_sweep
    out = tmp / "out"
    tb_files = sorted(out.glob("points/*/tb/events.*"))
    proc = cli("collect", "out", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    assert scripts_main()(["collect", str(out)]) == 0
    assert sorted(out.glob("points/*/tb/events.*")) == tb_files  # collect writes no events
    rows = read_csv(out / "results.csv")
    assert [r["point"] for r in rows] == ["d16_0", "d32_1", "d16_2"]
    assert [r["status"] for r in rows] == ["done", "done", "failed"]
    header = list(rows[0])
    assert header[:6] == ["point", "status", "model.dim", "data.source", "seed", "params"]
    for col in ("flops_per_token", "tokens", "flops", "final_val_loss", "best_val_loss", "final_train_loss",
                "wall_s", "tokens_per_s", "final_kurtosis_neuron_rms", "peak_kurtosis_neuron_rms",
                "final_max_abs_rest", "peak_max_abs_rest"):
        assert col in header
    rec = read_metrics(out / "points" / "d32_1" / "metrics.jsonl")
    assert float(rows[1]["final_train_loss"]) == pytest.approx(rec[6]["loss"])
    assert float(rows[1]["final_val_loss"]) == pytest.approx(rec[6]["val_loss"])
    assert float(rows[1]["best_val_loss"]) == pytest.approx(min(rec[3]["val_loss"], rec[6]["val_loss"]))
    kurt = [rec[s]["outliers/kurtosis_neuron_rms"] for s in (3, 6)]
    assert float(rows[1]["peak_kurtosis_neuron_rms"]) == pytest.approx(max(kurt))
    assert rows[2]["final_train_loss"] == ""
    md = (out / "results.md").read_text().splitlines()
    assert len(md) == 2 + 3 and md[2].startswith("| d16_0 | done | 16 |")
    import pyarrow.parquet as pq

    table = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["point"] for r in table] == ["d16_0", "d32_1", "d16_2"] and list(table[0]) == header
    assert table[1]["final_train_loss"] == pytest.approx(rec[6]["loss"]) and table[2]["final_train_loss"] is None
    # each point's axes once as hparams, in the run's tb folder beside its scalars
    acc = EventAccumulator(str(out / "points" / "d32_1" / "tb"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["model.dim"].number_value == 32 and hp["data.source"].string_value == "embedded"
    assert "loss" in acc.Tags()["scalars"]
    n_hparams = sum(b"_hparams_/session_start_info" in f.read_bytes() for f in tb_files
                    if f.parent.parent.name == "d32_1")
    assert n_hparams == 1


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def _checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_then_kill_9_then_rerun_resumes(tmp_path):
    """SIGTERM to the sweep stops its trainer cleanly at a checkpoint; kill -9 of the sweep takes the trainer
    down with it (PDEATHSIG); a rerun skips the finished point and resumes the interrupted one."""
    text = f"""
    base = "{BASE}"
    name = "p{{index}}"
    {TINY.replace("checkpoint.interval = 3", "checkpoint.interval = 5").replace("eval.every = 3", "eval.every = 0")
          .replace("observe.every = 3", "observe.every = 0").replace("training.steps = 6", "")}
    [zip]
    training.steps = [6, 40]
    """
    path = write(tmp_path, text)
    assert cli("plan", str(path), "--out", "out", cwd=tmp_path).returncode == 0
    out = tmp_path / "out"
    ckpts = out / "points" / "p1" / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def start_and_wait_for_checkpoint_after(step: int) -> subprocess.Popen:
        sweep = subprocess.Popen([sys.executable, str(REPO / "scripts" / "sweep.py"), "run", "out", "--local"],
                                 cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while not [s for s in _checkpoints(ckpts) if s > step] and time.time() < deadline and sweep.poll() is None:
            time.sleep(0.05)
        assert [s for s in _checkpoints(ckpts) if s > step], "the second point never checkpointed"
        return sweep

    # 1. SIGTERM: forwarded, the trainer checkpoints at its next step and exits; the point is pending
    sweep = start_and_wait_for_checkpoint_after(0)
    sweep.send_signal(signal.SIGTERM)
    _, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 1 and "SIGTERM received" in err, err
    stopped = _checkpoints(ckpts)[-1]
    assert 5 <= stopped < 40
    state = json.loads((out / "points" / "p1" / "sweep_state.json").read_text())
    assert state["status"] == "pending" and state["error"] == "interrupted" and state["returncode"] == 75  # stopped
    assert f"SIGTERM received: stopped after step {stopped}" in (out / "points" / "p1" / "train.log").read_text()

    # 2. kill -9: no chance to forward anything; PDEATHSIG stops the trainer
    sweep = start_and_wait_for_checkpoint_after(stopped)
    sweep.kill()
    sweep.wait()
    state = json.loads((out / "points" / "p1" / "sweep_state.json").read_text())
    assert state["status"] == "running" and state["attempts"] == 2
    deadline = time.time() + 60
    while not _gone(state["pid"]) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(state["pid"]), "the trainer outlived the killed sweep"
    lost = (out / "points" / "p1" / "train.log").stat().st_mtime - state["started"]  # the killed attempt's time
    interrupted_at = _checkpoints(ckpts)[-1]
    assert stopped < interrupted_at < 40
    assert cli("status", "out", cwd=tmp_path).stdout.splitlines()[2].split()[:2] == ["p1", "pending"]

    # 3. rerun: the finished point is not re-run, the interrupted one resumes from its checkpoint
    rerun = cli("run", "out", "--local", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    first = json.loads((out / "points" / "p0" / "sweep_state.json").read_text())
    assert first["attempts"] == 1
    assert (out / "points" / "p0" / "train.log").read_text().count("==== sweep attempt") == 1
    second = json.loads((out / "points" / "p1" / "sweep_state.json").read_text())
    assert second["attempts"] == 3 and second["status"] == "done"
    # the killed attempt's wall time is counted (up to its last log line), and said to be an estimate
    assert second["wall_s_estimated"] == pytest.approx(lost, abs=1e-3)
    assert second["wall_s"] > state["wall_s"] + lost
    log = (out / "points" / "p1" / "train.log").read_text()
    assert f"resumed from {ckpts / f'step-{stopped}'}" in log
    assert f"resumed from {ckpts / f'step-{interrupted_at}'}" in log
    assert cli("collect", "out", cwd=tmp_path).returncode == 0
    rows = read_csv(out / "results.csv")
    assert [r["point"] for r in rows] == ["p0", "p1"] and {r["status"] for r in rows} == {"done"}


# ------------------------------------------------------------------------------------------ run --slurm

FAKE_SBATCH = """#!{python}
# Fake sbatch: runs every array task of the script here, one after the other, with the Slurm variables set.
import os, re, subprocess, sys
script = sys.argv[-1]
text = open(script).read()
array = re.search(r"^#SBATCH --array=([0-9,]+)", text, re.M).group(1)
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
for index in array.split(","):
    env = dict(os.environ, SLURM_ARRAY_TASK_ID=index, SLURM_ARRAY_JOB_ID="4242", SLURM_JOB_ID="4243",
               SLURM_NNODES="1", SLURM_NODEID="0")
    subprocess.run(["bash", script], env=env, check=False)
print("Submitted batch job 4242")
"""


def test_slurm_print_only_script(tmp_path, capsys):
    path = write(tmp_path, THREE + "\n[slurm]\nnodes = 2\npartition = 'gpu'\ntime = '01:00:00'\n")
    out = tmp_path / "out"
    assert scripts_main()(["plan", str(path), "--out", str(out)]) == 0
    capsys.readouterr()
    rc = scripts_main()(["run", str(out), "--slurm", "--print-only", "--account", "proj", "--gpus-per-node", "4",
                         "--parallel", "2"])
    assert rc == 0
    script = capsys.readouterr().out
    assert script == (out / "slurm" / "sweep.sbatch").read_text() + "\n"
    for line in ("#SBATCH --array=0,1,2%2", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=01:00:00",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "trap requeue USR1",
                 'kill -USR1 "$child"', 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
                 "--rdzv-endpoint \"$head_ip:29500\""):
        assert line in script, line
    assert 'task ' in script and '--index "$SLURM_ARRAY_TASK_ID" --nproc 4' in script


@pytest.mark.slow
@pytest.mark.extended
def test_slurm_fake_sbatch_equals_local(tmp_path, local_sweep):
    local_tmp, path, _, _ = local_sweep
    assert cli("collect", "out", cwd=local_tmp).returncode == 0
    local_rows = read_csv(local_tmp / "out" / "results.csv")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(FAKE_SBATCH.format(python=sys.executable, log=str(tmp_path / "sbatch.log")))
    sbatch.chmod(0o755)
    assert cli("plan", str(path), "--out", "out", cwd=tmp_path).returncode == 0
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = cli("run", "out", "--slurm", "--gpus-per-node", "0", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Submitted batch job 4242" in proc.stdout
    assert (tmp_path / "sbatch.log").read_text().strip().endswith("sweep.sbatch")
    assert cli("collect", "out", cwd=tmp_path).returncode == 0
    slurm_rows = read_csv(tmp_path / "out" / "results.csv")
    assert list(slurm_rows[0]) == list(local_rows[0])
    assert_same_values(slurm_rows, local_rows)
    # only the unfinished (failed) point is submitted again
    proc = cli("run", "out", "--slurm", "--print-only", cwd=tmp_path, env=env)
    assert "#SBATCH --array=2\n" in proc.stdout


def test_an_option_added_since_planning_changes_nothing_at_its_default():
    from outlier_titan.study.plan import _config_diff

    old = '[job]\nname = "a"\n\n[training]\nsteps = 10\n'
    assert _config_diff(old, old.replace('"a"', '"b"')) == []  # job.* is not the point's science
    assert _config_diff(old, old + "seed = 0\n") == []  # written at its default (training.seed = 0)
    assert _config_diff(old, old + "seed = 3\n") == ["training.seed: 'default' -> 3"]
    assert _config_diff(old + "seed = 3\n", old) == ["training.seed: 3 -> 'default'"]
    assert _config_diff(old, old.replace("10", "20")) == ["training.steps: 10 -> 20"]


def test_an_optimizers_own_option_changes_only_that_optimizers_points():
    """optimizer.one_d belongs to orthoadam / soap: a changed value (e.g. a new default) leaves an AdamW point
    valid and marks an OrthoAdam point changed."""
    from outlier_titan.study.plan import _config_diff

    def cfg(name: str, one_d: str) -> str:
        return f'[optimizer]\nname = "{name}"\none_d = "{one_d}"\n'

    assert _config_diff(cfg("adamw", "adamw"), cfg("adamw", "auto")) == []
    assert _config_diff(cfg("orthoadam", "adamw"), cfg("orthoadam", "auto")) == ["optimizer.one_d: 'adamw' -> 'auto'"]
    assert _config_diff(cfg("adamw", "adamw"), cfg("soap", "auto")) == [
        "optimizer.name: 'adamw' -> 'soap'", "optimizer.one_d: 'adamw' -> 'auto'"]
