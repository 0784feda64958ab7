"""The optimizer registry from outside the package: a toy optimizer (signSGD with momentum, one plug-in file,
``tests/plugins/toy_optimizer.py``) with an option of its own (``optimizer.signsgd_beta``) trains through the trainer's
entry point, the dry run reports its state bytes, a checkpoint saved with it refuses a resume after one of its layout
keys changed, and a resume restores its config-owned hyperparameter from this run's config."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from outlier_titan.config.job_config import OPTIMIZER_NAMES
from outlier_titan.config.manager import parse_args
from outlier_titan.errors import UserError
from outlier_titan.options import opt
from outlier_titan.optim.registry import get_optimizer, optimizer_names, register_optimizer
from outlier_titan.parallel.dims import free_port
from outlier_titan.plugins import load_plugin
from outlier_titan.training.planning import plan
from outlier_titan.trainer import main as train_main
from tests.launch import REPO, TINY


TOY = load_plugin(str(REPO / "tests/plugins/toy_optimizer.py"))
SignSGD, SignSGDOptions, _signsgd, _check = TOY.SignSGD, TOY.SignSGDOptions, TOY._signsgd, TOY._check


def _run(monkeypatch, tmp_path, *overrides: str) -> int:
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    return train_main(["--config", str(REPO / "train_configs/debug.toml"), *TINY, "--job.dump_folder", str(tmp_path),
                       "--job.name", "run", "--optimizer.name", "signsgd", "--optimizer.lr", "3e-3", *overrides])


def test_registered_names_are_the_config_choices():
    assert {"adamw", "adam", "sgd", "rmsprop", "orthoadam", "soap", "muon", "signsgd"} <= set(optimizer_names())
    assert tuple(OPTIMIZER_NAMES) == optimizer_names()
    with pytest.raises(UserError, match=r"'nope' is not registered; choose one of: adamw, .*signsgd"):
        get_optimizer("nope")
    with pytest.raises(UserError, match="already registered"):
        register_optimizer("adamw", _signsgd, state_bytes=8)
    with pytest.raises(UserError, match="not_a_key"):
        register_optimizer("toy2", _signsgd, state_bytes=8, layout_keys=("not_a_key",))
    with pytest.raises(UserError, match="pass one of state_bytes"):
        register_optimizer("toy2", _signsgd)
    with pytest.raises(UserError, match="state_bytes must be a number >= 0"):
        register_optimizer("toy2", _signsgd, state_bytes=-1)
    assert "toy2" not in optimizer_names()


def test_the_toy_optimizer_brings_its_own_option(tmp_path):
    from outlier_titan.config.manager import help_text, to_toml
    from outlier_titan.optim.builder import build_optimizer

    base = ["--config", str(REPO / "train_configs/debug.toml"), "--optimizer.name", "signsgd"]
    assert parse_args(base).optimizer.signsgd_beta == 0.9
    cfg = parse_args(base + ["--optimizer.signsgd_beta", "0.5"])
    assert cfg.optimizer.signsgd_beta == 0.5
    opt_ = build_optimizer(torch.nn.Linear(4, 4), cfg.optimizer, seed=0)
    assert isinstance(opt_, SignSGD) and {g["beta"] for g in opt_.param_groups} == {0.5}
    (tmp_path / "c.toml").write_text(to_toml(cfg))  # a saved run config loads back with the option
    assert parse_args(["--config", str(tmp_path / "c.toml")]).optimizer.signsgd_beta == 0.5
    text = help_text()
    assert "  -- options of optimizer 'signsgd':\n  --optimizer.signsgd_beta " in text
    with pytest.raises(UserError, match="expected float"):
        parse_args(base + ["--optimizer.signsgd_beta", "high"])
    # the same registration again is a no-op; a key another owner has is refused, naming the fix
    register_optimizer("signsgd", _signsgd, state_bytes=4, options=SignSGDOptions, replace=True)
    TOY.register()

    @dataclasses.dataclass
    class Clash:
        tile_size: int = opt(3, "toy: clashes with the tile engine's key.")

    with pytest.raises(UserError, match=r"optimizer.tile_size already exists; .*\(e.g. toy3_tile_size\)"):
        register_optimizer("toy3", _signsgd, state_bytes=0, options=Clash)
    assert "toy3" not in optimizer_names()


def test_toy_optimizer_trains_plans_and_guards_its_layout(monkeypatch, tmp_path, capsys):
    # trains: the loss falls over 8 steps
    assert _run(monkeypatch, tmp_path, "--training.steps", "8", "--checkpoint.enable", "true",
                "--checkpoint.interval", "4") == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    capsys.readouterr()

    # the dry run: printed under the toy's name; 4 bytes per element with momentum, none without
    assert _run(monkeypatch, tmp_path / "dry", "--job.dry_run", "true", "--parallelism.dp_shard", "1") == 0
    assert "optimizer state (signsgd)" in capsys.readouterr().out
    for momentum, per_element in ((True, 4), (False, 0)):
        cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--parallelism.dp_shard", "1",
                          "--optimizer.name", "signsgd", "--optimizer.momentum", str(momentum).lower()])
        pl = plan(cfg)
        assert pl.optimizer_bytes == per_element * pl.local_params > 0 or per_element == pl.optimizer_bytes == 0

    # a declared layout key changed: the resume is refused, one line naming the key
    assert _run(monkeypatch, tmp_path, "--training.steps", "12", "--lr_scheduler.total_steps", "8",
                "--checkpoint.enable", "true", "--optimizer.momentum", "false") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "optimizer.momentum True -> False (the signsgd optimizer state layout differs)" in err, err

    # extra validation, and an unknown name listing the registered ones
    assert _run(monkeypatch, tmp_path / "bad", "--optimizer.lr", "0.5") == 2
    assert "signsgd: optimizer.lr must be <= 0.1, got 0.5" in capsys.readouterr().err
    assert _run(monkeypatch, tmp_path / "bad", "--optimizer.name", "nope") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'nope' is not allowed; choose one of: adamw, adam, sgd" in err and err.endswith("signsgd"), err


def _toml(**optimizer) -> str:
    return "[optimizer]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in optimizer.items())  # TOML here


@pytest.mark.parametrize("saved, current, key, why", [
    (dict(name="orthoadam", tile_size=32), dict(name="orthoadam", tile_size=64), "optimizer.tile_size",
     "the orthoadam optimizer state layout differs"),
    (dict(name="orthoadam", shard_tile_size=8), dict(name="orthoadam", shard_tile_size=16),
     "optimizer.shard_tile_size", "the orthoadam optimizer state layout differs"),
    (dict(name="soap", max_shards=4), dict(name="soap", max_shards=8), "optimizer.max_shards",
     "the soap optimizer state layout differs"),
    (dict(name="soap", soap_factor_dtype="float64"), dict(name="soap", soap_factor_dtype="float32"),
     "optimizer.soap_factor_dtype", "the soap optimizer state layout differs"),
    (dict(name="adamw", no_decay=["norm"]), dict(name="adamw", no_decay=["norm", "bias"]), "optimizer.no_decay",
     "the adamw optimizer state layout differs"),
    (dict(name="adamw"), dict(name="soap"), "optimizer.name", "the optimizer state differs"),
    # keys an optimizer does not use leave its state alone
    (dict(name="adamw", tile_size=32), dict(name="adamw", tile_size=64), "optimizer.tile_size", None),
    (dict(name="soap", basis="haar"), dict(name="soap", basis="hadamard"), "optimizer.basis", None),
    (dict(name="muon", muon_layout="full"), dict(name="muon", muon_layout="block"), "optimizer.muon_layout", None),
    (dict(name="signsgd", momentum=True), dict(name="signsgd", momentum=False), "optimizer.momentum",
     "the signsgd optimizer state layout differs"),
])
def test_resume_check_reads_the_layout_keys_of_the_registration(saved, current, key, why):
    from outlier_titan.checkpoint.manager import config_changes

    changes = {k: w for k, _, _, w in config_changes(_toml(**saved), _toml(**current))}
    assert changes[key] == why


def test_dry_run_applies_the_registration_s_validation():
    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--parallelism.dp_shard", "1",
                      "--optimizer.name", "signsgd", "--optimizer.lr", "0.5"])
    with pytest.raises(UserError, match=r"signsgd: optimizer.lr must be <= 0.1, got 0.5"):
        plan(cfg)


def test_the_basis_choices_are_the_bases():
    from outlier_titan.optim.bases import REPRESENTATIONS
    from outlier_titan.optim.tiles.settings import BASES

    assert sorted(BASES) == sorted(REPRESENTATIONS)


def test_the_engine_reads_every_key_of_its_option_group_with_the_same_defaults():
    import dataclasses as dc

    from outlier_titan.models.roles import DEFAULT_ROLES
    from outlier_titan.optim.tile_optimizers import TILE_LAYOUT_KEYS, engine_options
    from outlier_titan.optim.tiles.options import EngineOptions
    from outlier_titan.optim.tiles.settings import TileOptions

    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--optimizer.name", "soap",
                      "--optimizer.tile_size", "16", "--optimizer.tile_size_overrides", "output.weight=8"]).optimizer
    e = engine_options(cfg, DEFAULT_ROLES)
    assert (e.tile_size, e.tile_size_overrides, e.nonfinite_guard) == (16, ("output.weight=8",), False)
    engine = {f.name: f.default for f in dc.fields(EngineOptions)}
    for f in dc.fields(TileOptions):
        assert f.name in TILE_LAYOUT_KEYS
        default = f.default_factory() if f.default is dc.MISSING else f.default
        assert engine[f.name] == (tuple(default) if isinstance(default, list) else default), f.name


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_torch_adam_kernels_follow_optimizer_implementation_and_agree(name):
    """``optimizer.implementation``: ``auto`` is foreach on the CPU (where the reports were trained; a GPU takes
    the fused kernel, tests/test_gpu.py), ``fused`` and ``foreach`` as asked; the two train a small model to the
    same parameters to float64 rounding."""
    from outlier_titan.config.job_config import Optimizer
    from outlier_titan.optim.builder import build_optimizer
    from tests.small_model import learnable_batches, tiny_model, train_losses

    finals = {}
    for impl in ("auto", "fused", "foreach"):
        model = tiny_model()
        opt_ = build_optimizer(model, Optimizer(name=name, lr=1e-2, implementation=impl), seed=0)
        group = opt_.param_groups[0]
        assert bool(group["fused"]) == (impl == "fused") and bool(group["foreach"]) == (impl != "fused")
        losses = train_losses(model, opt_, learnable_batches(10))
        assert losses[-1] < losses[0]
        finals[impl] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(finals["fused"], finals["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    from outlier_titan.errors import ConfigError

    with pytest.raises(ConfigError, match="choose one of: auto, fused, foreach"):
        parse_args(["--optimizer.implementation", "fast"])


def test_a_resumed_run_takes_its_own_adam_kernel_not_the_checkpoints(tmp_path):
    """torch restores a group's fused / foreach flags from the checkpoint; the resumed run keeps its own
    ``optimizer.implementation`` (saved with foreach, resumed fused), with the moments and step counts loaded."""
    import torch.distributed.checkpoint as dcp

    from outlier_titan.checkpoint.manager import OptimizerState
    from outlier_titan.config.job_config import Optimizer
    from outlier_titan.optim.builder import build_optimizer
    from tests.small_model import learnable_batches, tiny_model, train_losses

    batches = learnable_batches(8)
    model = tiny_model()
    saved = build_optimizer(model, Optimizer(name="adamw", lr=1e-2, implementation="foreach"), seed=0)
    train_losses(model, saved, batches[:4])
    dcp.save({"optimizer": OptimizerState(model, saved)}, checkpoint_id=str(tmp_path))
    model.zero_grad(set_to_none=True)  # as at a resume: DCP initialises the state only without gradients
    resumed = build_optimizer(model, Optimizer(name="adamw", lr=1e-2, implementation="fused"), seed=0)
    dcp.load({"optimizer": OptimizerState(model, resumed)}, checkpoint_id=str(tmp_path))
    assert all(g["fused"] and not g["foreach"] for g in resumed.param_groups)
    for p in model.parameters():
        assert torch.equal(resumed.state[p]["exp_avg_sq"], saved.state[p]["exp_avg_sq"])
        assert float(resumed.state[p]["step"]) == 4.0 and resumed.state[p]["step"].dtype == torch.float32
    losses = train_losses(model, resumed, batches[4:])
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("owned", [True, False])
def test_a_resume_restores_the_plugins_config_owned_hyperparameters(monkeypatch, tmp_path, owned):
    """Saved with beta 0.5, resumed with 0.7: the steps after the resume use 0.7 because the optimizer registered
    ``beta`` as config-owned; without that registration they keep the checkpoint's 0.5 (the test can fail)."""
    seen = []
    step = SignSGD.step
    monkeypatch.setattr(SignSGD, "step", lambda self, closure=None: (
        seen.append({g["beta"] for g in self.param_groups}), step(self, closure))[1])
    if not owned:
        register_optimizer("signsgd", _signsgd, state_bytes=lambda cfg: 4.0 if cfg.momentum else 0.0,
                           layout_keys=("momentum",), validate=_check, options=SignSGDOptions, replace=True)
    try:
        common = ["--checkpoint.enable", "true", "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "6"]
        assert _run(monkeypatch, tmp_path, "--training.steps", "4", "--optimizer.signsgd_beta", "0.5", *common) == 0
        seen.clear()
        assert _run(monkeypatch, tmp_path, "--training.steps", "6", "--optimizer.signsgd_beta", "0.7", *common) == 0
    finally:
        TOY.register()
    assert seen[-2:] == [{0.7 if owned else 0.5}] * 2, seen  # steps 5 and 6 (before them: the state's init)
