#!/usr/bin/env python
"""Fit scaling laws to a collected sweep table (Franke et al. 2025's method) and plot them.

    outlier-titan-fit-scaling SWEEP_DIR/results.csv --family model.name --out SWEEP_DIR/fit

Only rows with status ``done`` are fitted (all rows if the table has no ``status`` column). Per family: the
minimum loss in each of K log-spaced compute bins (the frontier), ``L(C) = A0·C^(−α)`` (``--irreducible``:
``E + A0·C^(−α)``), ``N_opt(C) = N0·C^(α_N)`` and ``D_opt(C) = D0·C^(α_D)`` through the frontier points, 95%
intervals (delta method; ``--bootstrap B``: percentiles of B resampled refits), z-tests of equal exponents
between families, and with ``--hparam COL`` the per-size optimum of that column with a power law in N.

Writes ``OUT/fit.json``, ``OUT/fit.md`` (also printed), ``OUT/loss_vs_compute.png``, ``OUT/compute_optimal.png``
and with ``--hparam`` ``OUT/hparam_vs_params.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from outlier_titan import cli
from outlier_titan.errors import UserError
from outlier_titan.study.fit import MIN_BINS, fit_table
from outlier_titan.study.fit_report import to_json, to_markdown


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("table", help="collected sweep table (CSV)")
    p.add_argument("--family", default=None,
                   help="column whose values split the rows into model families, e.g. model.name "
                        "(default: none, one family)")
    p.add_argument("--loss", default="best_val_loss", help="loss column (default: %(default)s)")
    p.add_argument("--compute", default="flops", help="compute column (default: %(default)s)")
    p.add_argument("--params", default="params", help="model-size column for N_opt (default: %(default)s)")
    p.add_argument("--tokens", default="tokens", help="token-count column for D_opt (default: %(default)s)")
    p.add_argument("--bins", type=int, default=None,
                   help=f"log-spaced compute bins (default: max({MIN_BINS}, points // 3) per family)")
    p.add_argument("--irreducible", action="store_true", help="fit E + A0·C^-alpha instead of A0·C^-alpha")
    p.add_argument("--bootstrap", type=int, default=0, metavar="B",
                   help="bootstrap intervals from B resampled refits (default: 0, delta method)")
    p.add_argument("--hparam", default=None, metavar="COL",
                   help="also fit the per-size optimum of this column vs N, e.g. optimizer.lr (default: off)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap random seed (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="output folder (default: a 'fit' folder next to the table)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    args = parse(argv)
    try:
        if args.bootstrap < 0:
            raise UserError(f"--bootstrap must be 0 (delta method) or a number of resamples, got {args.bootstrap}")
        res = fit_table(args.table, loss=args.loss, compute=args.compute, params=args.params, tokens=args.tokens,
                        family=args.family, bins=args.bins, irreducible=args.irreducible,
                        bootstrap=args.bootstrap, hparam=args.hparam, seed=args.seed)
        out = Path(args.out) if args.out else Path(args.table).resolve().parent / "fit"
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; pass a folder")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from outlier_titan.study.plots import plot_compute_optimal, plot_hparam, plot_loss_vs_compute

    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps(to_json(res), indent=2) + "\n")
    md = to_markdown(res)
    (out / "fit.md").write_text(md)
    plot_loss_vs_compute(res, out / "loss_vs_compute.png")
    plot_compute_optimal(res, out / "compute_optimal.png")
    if args.hparam:
        plot_hparam(res, out / "hparam_vs_params.png")
    print(md)
    print(f"wrote {out}/fit.json, fit.md and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
