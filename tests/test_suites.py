"""Every reproduction suite runs the papers' remedies as published: no point inherits the debug model's tiles.

The rule each suite states (``train_configs/suites/<suite>/*.toml``, the ``[fixed]`` comment): OrthoAdam and SOAP
rotate every axis whole (``optimizer.tile_size = 0``) up to ``max_precond_dim``, the vocabulary axis included.
This loads every point's resolved config and checks the tile edge the engine plans per parameter against it.
"""

import pytest

from outlier_titan.models.registry import build_meta_model
from outlier_titan.models.roles import roles_of
from outlier_titan.optim.builder import build_param_groups
from outlier_titan.optim.tile_optimizers import tile_plans
from outlier_titan.study.suites import SUITES
from outlier_titan.study.spec import _vocab_size, load_sweep
from tests.launch import REPO

FILES = sorted(p for s in SUITES for p in (REPO / "train_configs" / "suites" / s).glob("*.toml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_tile_optimizer_point_rotates_whole_axes(path):
    checked = 0
    for point in load_sweep(path).points:
        opt = point.cfg.optimizer
        if opt.name not in ("orthoadam", "soap"):
            continue
        # the suites' rule: whole axes; the tile-size study's: square tiles of the point's own edge
        study = path.stem == "tiles"
        assert (opt.tile_size in (0, 128, 64, 32) if study else opt.tile_size == 0), point.name
        assert opt.vocab_axis == "tile", point.name
        _, _, model = build_meta_model(point.cfg.model, _vocab_size(point.cfg.data.tokenizer),
                                       point.cfg.training.seq_len)
        # 1-D parameters as each method is published: OrthoAdam's Algorithm 1 rotates them, SOAP does not
        one_d_rotates = opt.one_d == "rotate" or (opt.one_d == "auto" and opt.name == "orthoadam")
        assert one_d_rotates == (opt.name == "orthoadam"), point.name
        for p, fqn, plan in tile_plans(build_param_groups(model, opt), opt, roles_of(model)):
            for size, axis in zip(p.shape, plan.axes):
                rotates = 2 <= size <= opt.max_precond_dim and (p.ndim == 2 or one_d_rotates)
                want = min(opt.tile_size, size) if opt.tile_size else size
                assert axis.rotate == rotates and axis.tile == (want if rotates else axis.tile), (point.name, fqn)
                checked += 1
    if path.stem in ("cpu", "smoke", "synthetic", "tiles") and path.parent.name in ("kaul2024", "he2024"):
        assert checked, f"{path} has no OrthoAdam / SOAP point"


@pytest.mark.parametrize("path", [p for p in FILES if p.stem in ("cpu", "provoked", "synthetic", "tiles")],
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_cpu_and_synthetic_scales_run_three_seeds_per_setting(path):
    sweep = load_sweep(path)
    seeds = sorted({p.axes.get("seed") for p in sweep.points})
    assert len(seeds) >= 3 and "seed" in sweep.axes


@pytest.mark.parametrize("suite, source, arms, seeds", [
    ("kaul2024", "tuned", ("adam", "orthoadam"), 5),
    ("he2024", "cpu", ("pre_ln_adamw", "op_soap"), 3),
    ("he2024", "tuned", ("op_soap",), 5),  # the baseline is tuned at 1e-3, the study runs it at 3e-3
])
def test_the_tile_study_shares_its_baseline_and_whole_axis_points_with_another_scale(suite, source, arms, seeds,
                                                                                     tmp_path):
    """Their configs (learning rates from the lr search applied) equal that scale's, checkpointing aside, so
    ``--adopt reports/<suite>-<source>`` takes them instead of training them twice; the tiled points are the
    study's own. kaul2024's study runs at the tuned lrs, he2024's at the cpu scale's provoking one, which is OP +
    SOAP's tuned lr too."""
    from outlier_titan.study.plan import _config_diff, build_manifest
    from outlier_titan.study.adopt import ADOPT_IGNORES
    from outlier_titan.study.suite_files import suite_sweep

    other = [e["config"] for e in build_manifest(suite_sweep(suite, source), tmp_path / source)["points"]]
    shared = set()
    for e in build_manifest(suite_sweep(suite, "tiles"), tmp_path / "tiles")["points"]:
        if any(not _config_diff(c, e["config"], ignore=ADOPT_IGNORES) for c in other):
            shared.add(e["name"])
    assert shared == {f"{arm}_t0_s{seed}" for arm in arms for seed in range(seeds)}, shared
