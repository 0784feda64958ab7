"""Scaling-law fitter: recovery of known laws, interval coverage, Franke et al. 2025's Table I.1, the CLI end to end."""

from __future__ import annotations

import csv
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from outlier_titan.errors import UserError
from outlier_titan.study.fit import (PowerLaw, default_bins, fit_power_law, fit_table, frontier, hparam_optimum,
                                     z_test)

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["point", "status", "model.name", "model.dim", "optimizer.lr", "seed", "params", "flops_per_token",
           "tokens", "flops", "final_val_loss", "best_val_loss", "final_train_loss", "wall_s", "tokens_per_s"]

# Chinchilla-form truth without the irreducible term: L(N, D) = A·N^-a + B·D^-b, C = 6·N·D. Its compute-optimal
# frontier is exactly N_opt ∝ C^(b/(a+b)), D_opt ∝ C^(a/(a+b)), L_opt ∝ C^(-ab/(a+b)).
A, B, a, b = 406.4, 410.7, 0.34, 0.28
ALPHA, ALPHA_N, ALPHA_D = a * b / (a + b), b / (a + b), a / (a + b)


def coverage_threshold(draws: int, level: float = 0.95, tail: float = 1e-3) -> int:
    """Fewest covering draws we accept: a correctly calibrated interval falls below it with probability < tail."""
    return int(stats.binom.ppf(tail, draws, level))


def chinchilla_loss(n, d):
    return A * n ** -a + B * d ** -b


def n_opt_true(c):
    # argmin over N of L(N, C/(6N)): a·A·N^-a = b·B·D^-b.
    g = (a * A / (b * B)) ** (1 / (a + b))
    return g * (c / 6) ** ALPHA_N


def write_table(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for i, r in enumerate(rows):
            base = {"point": f"p{i:03d}", "status": "done", "model.name": "gpt", "model.dim": 64,
                    "optimizer.lr": 1e-3, "seed": 0, "flops_per_token": 6 * r["params"], "wall_s": 10.0,
                    "tokens_per_s": 1000.0}
            base.update(r)
            base.setdefault("flops", 6 * base["params"] * base["tokens"])
            base.setdefault("final_val_loss", base["best_val_loss"])
            base.setdefault("final_train_loss", base["best_val_loss"])
            w.writerow(base)
    return path


def isoflop_rows(rng, noise=0.002, family="gpt", scale=1.0):
    """IsoFLOP design: 9 sizes around the true optimum at each of 13 compute levels (1e15 … 1e21)."""
    rows = []
    for c in np.logspace(15, 21, 13):
        for f in 2.0 ** np.arange(-2, 2.5, 0.5):
            n = n_opt_true(c) * f
            d = c / (6 * n)
            loss = scale * chinchilla_loss(n, d) * math.exp(rng.normal(0, noise))
            rows.append({"model.name": family, "params": n, "tokens": d, "flops": c, "best_val_loss": loss})
    return rows


def test_power_law_exponent_and_interval_coverage():
    """L = A0·C^-α with 1% log-normal noise, 100 draws (seed 0): the first draw's α within 2%; the 95% intervals
    of α and of the extrapolated loss at 10× the largest C cover the truth in at least
    coverage_threshold(100) draws (88: a calibrated 95% interval fails that with p < 0.001); the reported
    standard error matches the spread of the estimates across draws within 20% (intervals not too wide)."""
    rng = np.random.default_rng(0)
    a0, alpha = 30.0, 0.1
    c = np.logspace(15, 20, 12)
    cover_a = cover_band = 0
    est, ses = [], []
    for k in range(100):
        y = a0 * c ** -alpha * np.exp(rng.normal(0, 0.01, len(c)))
        law = fit_power_law(c, y)
        if k == 0:
            assert abs(-law.exponent / alpha - 1) < 0.02
            assert abs(law.coef / a0 - 1) < 0.2
        lo, hi = law.intervals()["exponent"]
        cover_a += lo <= -alpha <= hi
        blo, bhi = law.band([1e21])
        cover_band += blo[0] <= a0 * 1e21 ** -alpha <= bhi[0]
        est.append(law.exponent)
        ses.append(math.sqrt(law.exponent_var))
    need = coverage_threshold(100)
    assert cover_a >= need and cover_band >= need, (cover_a, cover_band, need)
    assert 0.8 < np.mean(ses) / np.std(est, ddof=1) < 1.25
    assert abs(-np.mean(est) / alpha - 1) < 0.005


def test_irreducible_form_recovers_constants():
    """E + A0·C^-α with 0.2% noise, 40 draws: the first draw's α within 2% and E within 5%; the α interval
    covers the truth in at least coverage_threshold(40) draws."""
    rng = np.random.default_rng(1)
    e, a0, alpha = 1.7, 400.0, 0.12
    c = np.logspace(15, 21, 16)
    cover = 0
    for k in range(40):
        y = (e + a0 * c ** -alpha) * np.exp(rng.normal(0, 0.002, len(c)))
        law = fit_power_law(c, y, irreducible=True)
        if k == 0:
            assert abs(-law.exponent / alpha - 1) < 0.02
            assert abs(law.offset / e - 1) < 0.05
        lo, hi = law.intervals()["exponent"]
        cover += lo <= -alpha <= hi
    assert cover >= coverage_threshold(40), cover


def test_bootstrap_intervals_agree_with_delta_method():
    rng = np.random.default_rng(2)
    c = np.logspace(15, 20, 12)
    y = 30.0 * c ** -0.1 * np.exp(rng.normal(0, 0.01, len(c)))
    delta = fit_power_law(c, y)
    boot = fit_power_law(c, y, bootstrap=300, seed=0)
    assert boot.boot.shape == (300, 2)
    assert boot.exponent == pytest.approx(delta.exponent)
    (dl, dh), (bl, bh) = delta.intervals()["exponent"], boot.intervals()["exponent"]
    assert bl <= -0.1 <= bh
    assert 0.5 < (bh - bl) / (dh - dl) < 2.0
    lo, hi = boot.band(c)
    assert np.all(lo < boot(c)) and np.all(boot(c) < hi)


def test_sweep_table_recovers_compute_optimal_laws(tmp_path):
    """A synthetic IsoFLOP sweep (117 done points, plus a failed and a NaN row) through fit_table: the frontier
    is one point per compute level, and α, α_N, α_D are within 2% of the truth with the truth in the intervals."""
    rows = isoflop_rows(np.random.default_rng(3))
    rows.append(dict(rows[0], status="failed", best_val_loss=0.01))
    rows.append(dict(rows[1], best_val_loss="nan"))
    table = write_table(tmp_path / "results.csv", rows)
    res = fit_table(table)
    assert res.rows_used == 117 and res.rows_skipped == {"not done": 1, "missing values": 1}
    (fam,) = res.families
    assert fam.bins == default_bins(117) == 39
    assert len(fam.front) == 13
    for law, truth in ((fam.loss_law, -ALPHA), (fam.n_opt, ALPHA_N), (fam.d_opt, ALPHA_D)):
        assert abs(law.exponent / truth - 1) < 0.02, (law.exponent, truth)
        lo, hi = law.intervals()["exponent"]
        assert lo <= truth <= hi
    # N0·C^α_N times D0·C^α_D must give back C/6.
    assert fam.n_opt(1e19) * fam.d_opt(1e19) * 6 / 1e19 == pytest.approx(1.0, rel=0.05)


def test_seeds_are_averaged(tmp_path):
    """Two seeds of every configuration: the frontier loss is their mean (not the luckier seed)."""
    rows0 = isoflop_rows(np.random.default_rng(9))
    rows1 = [dict(r, seed=1, best_val_loss=r["best_val_loss"] * 1.01) for r in rows0]
    rows1[0]["best_val_loss"] = rows0[0]["best_val_loss"] * 0.5
    res = fit_table(write_table(tmp_path / "results.csv", rows0 + rows1))
    assert res.rows_used == 234 and res.configs == 117
    (fam,) = res.families
    # The halved seed-1 loss of the first point makes that configuration the lowest of its level on average.
    assert fam.loss[fam.front[0]] == pytest.approx(0.75 * rows0[0]["best_val_loss"])
    assert fam.compute[fam.front[0]] == rows0[0]["flops"] and fam.params[fam.front[0]] == rows0[0]["params"]


def test_frontier_bins_and_default_count():
    # ln C spans 0 … ln 200 in three equal bins: [1, 5.8), [5.8, 34), [34, 200].
    c = [1, 2, 10, 20, 100, 200, 150]
    loss = [5, 4, 3, 3.5, 2, 1, 0.5]
    assert frontier(c, loss, 3).tolist() == [1, 2, 6]
    # Six bins (edges 1, 2.4, 5.8, 14, 34, 83, 200): two are empty and dropped; 100, 150, 200 share the last.
    assert frontier(c, loss, 6).tolist() == [1, 2, 3, 6]
    assert [default_bins(n) for n in (3, 6, 9, 30, 3000)] == [3, 3, 3, 10, 1000]


def test_franke2025_table_i1_compute_optimal_and_z_test():
    """Table I.1 of Franke et al. 2025 gives the published N_opt, D_opt (to their printed digits), and the
    z-test on the published variances gives p = 0.073 at the exponent difference the paper implies."""
    table = {"GPT+": (13.408079, 0.466271, 0.336617, 0.465600), "anGPT": (9.727337, 0.473190, 0.650506, 0.451378)}
    published = {("GPT+", 1e18): (8.1e7, 3.3e9), ("anGPT", 1e18): (8.7e7, 3.2e9),
                  ("GPT+", 1e20): (6.9e8, 2.84e10), ("anGPT", 1e20): (6.9e8, 2.83e10)}
    for (model, c), (n_pub, d_pub) in published.items():
        d0, a_d, n0, a_n = table[model]
        n, d = PowerLaw.from_constants(n0, a_n)(c), PowerLaw.from_constants(d0, a_d)(c)
        for got, pub in ((n, n_pub), (d, d_pub)):
            digits = 2 if pub in (8.1e7, 3.3e9, 8.7e7, 3.2e9, 6.9e8) else 3
            assert float(f"{got:.{digits}g}") == pub, (model, c, got, pub)
    var_angpt, var_gpt = 1.11e-6, 1.08e-6
    # The paper reports σ² and p but not Δα: invert its p for Δα, then check the test reproduces p = 0.073 and
    # that a larger difference would have been significant.
    diff = stats.norm.isf(0.073 / 2) * math.sqrt(var_angpt + var_gpt)
    assert diff == pytest.approx(0.002653, abs=5e-7)
    z, p = z_test(0.5 + diff, var_gpt, 0.5, var_angpt)
    assert round(p, 3) == 0.073 and z == pytest.approx(1.7928, abs=1e-3)
    assert z_test(0.5 + 1.5 * diff, var_gpt, 0.5, var_angpt)[1] < 0.05
    assert z_test(0.3, 0.0, 0.3, 0.0) == (0.0, 1.0) and z_test(0.3, 0.0, 0.2, 0.0) == (math.inf, 0.0)


def hparam_rows(rng, sizes, grid, c_exp=-0.25, edge_size=None):
    rows = []
    for n in sizes:
        lr_star = 0.01 * (n / 1e7) ** c_exp
        if n == edge_size:
            lr_star = grid[-1] * 4
        for lr in grid:
            z = math.log(lr / lr_star)
            loss = (3.0 + 0.05 * z * z + 0.01 * abs(z) ** 3) * math.exp(rng.normal(0, 1e-4))
            rows.append({"params": n, "tokens": 20 * n, "optimizer.lr": lr, "best_val_loss": loss})
    return rows


def test_hparam_optimum_power_law_in_n(tmp_path):
    """lr*(N) = 0.01·(N/1e7)^-0.25 on a factor-2 lr grid, 5 sizes + 1 whose optimum lies beyond the grid: the
    Akima optima give the exponent within 2%; the unbracketed size is flagged 'edge' and left out of the fit; a
    run at lr 0 (no log) is left out of the optimum but still counts for the loss-vs-compute fit."""
    grid = 0.01 * 2.0 ** np.arange(-3, 4)
    sizes = list(np.logspace(6, 8, 5)) + [3e8]
    rows = hparam_rows(np.random.default_rng(4), sizes, grid, edge_size=3e8)
    rows.append(dict(rows[0], **{"optimizer.lr": 0.0, "best_val_loss": 9.0}))
    res = fit_table(write_table(tmp_path / "results.csv", rows), hparam="optimizer.lr")
    assert res.rows_used == len(rows) == 43
    (fam,) = res.families
    hows = [r["how"] for r in fam.hparam["sizes"]]
    assert hows == ["interp"] * 5 + ["edge"]
    assert abs(fam.hparam_law.exponent / -0.25 - 1) < 0.02
    assert hparam_optimum([1e-3, 2e-3], [3.1, 3.0]) == (2e-3, 3.0, "grid")
    bad = hparam_rows(np.random.default_rng(5), sizes[:3], grid[:3], edge_size=None)
    with pytest.raises(UserError, match="needs at least 3"):
        fit_table(write_table(tmp_path / "bad.csv", bad), hparam="optimizer.lr")


def test_cli_end_to_end(tmp_path):
    """Two families through scripts/fit_scaling.py in a subprocess: files written, z-tests reported."""
    rng = np.random.default_rng(6)
    rows = isoflop_rows(rng, family="gpt") + isoflop_rows(rng, family="angpt", scale=0.97)
    rows.append(dict(rows[0], status="running"))
    table = write_table(tmp_path / "results.csv", rows)
    out = tmp_path / "fit"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "fit_scaling.py"), str(table), "--family",
                           "model.name", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "fit.json").read_text())
    assert set(report["families"]) == {"gpt", "angpt"}
    assert report["rows_skipped"]["not done"] == 1
    for fam in report["families"].values():
        assert fam["loss"]["alpha"]["value"] == pytest.approx(ALPHA, rel=0.02)
        assert fam["loss"]["alpha"]["lo"] < fam["loss"]["alpha"]["value"] < fam["loss"]["alpha"]["hi"]
    # Same law up to a constant factor: the exponents must not differ significantly.
    (loss_test,) = [t for t in report["ztests"] if t["exponent"] == "alpha"]
    assert loss_test["p"] > 0.05
    md = (out / "fit.md").read_text()
    assert "z-test" in md and "| angpt |" in md
    for png in ("loss_vs_compute.png", "compute_optimal.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_exit_2_and_hparam_plot(tmp_path, capsys):
    main = importlib.import_module("outlier_titan.tools.fit_scaling").main
    table = write_table(tmp_path / "results.csv", isoflop_rows(np.random.default_rng(7))[:2])
    cases = [([str(tmp_path / "missing.csv")], "no such file"),
             ([str(table), "--loss", "val_ppl"], "no column 'val_ppl' (--loss)"),
             ([str(table)], "needs at least 3"),
             ([str(table), "--bins", "1"], "--bins must be at least 3"),
             ([str(table), "--bootstrap", "-1"], "--bootstrap")]
    for argv, msg in cases:
        assert main(argv + ["--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()
    grid = 0.01 * 2.0 ** np.arange(-3, 4)
    hp = write_table(tmp_path / "lr.csv", hparam_rows(np.random.default_rng(8), list(np.logspace(6, 8, 4)), grid))
    assert main([str(hp), "--hparam", "optimizer.lr", "--out", str(tmp_path / "lr")]) == 0
    assert (tmp_path / "lr" / "hparam_vs_params.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "lr" / "fit.json").read_text())["families"]["all"]["hparam"]["law"]
