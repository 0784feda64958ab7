"""The scaling-law fit's report (``scripts/fit_scaling.py``): the fitted constants of :func:`~outlier_titan.study.fit.fit_table`
with their intervals as JSON and as markdown."""

from __future__ import annotations

from outlier_titan.study.fit import LEVEL, MIN_BINS, FitResult, PowerLaw


def _law_dict(law: PowerLaw, coef: str, exp: str, negate: bool = False) -> dict:
    """A power law's constants with their intervals, under the report's names (``negate``: the exponent's sign
    flipped, as the loss law prints ``alpha`` of ``C^-alpha``)."""
    iv = law.intervals()
    s = -1.0 if negate else 1.0
    elo, ehi = sorted((s * iv["exponent"][0], s * iv["exponent"][1]))
    out = {coef: {"value": law.coef, "lo": iv["coef"][0], "hi": iv["coef"][1]},
           exp: {"value": s * law.exponent, "lo": elo, "hi": ehi, "var": law.exponent_var},
           "points": law.n, "dof": law.dof, "rmse_log": law.rmse_log}
    if law.irreducible:
        out["E"] = {"value": law.offset, "lo": iv["offset"][0], "hi": iv["offset"][1]}
    return out


def to_json(res: FitResult) -> dict:
    """A JSON-ready summary: fitted constants with their 95% intervals per family, frontier points, z-tests."""
    fams = {}
    for f in res.families:
        d = {"points": int(len(f.compute)), "bins": f.bins,
             "frontier": [{"compute": float(f.compute[i]), "loss": float(f.loss[i]), "params": float(f.params[i]),
                           "tokens": float(f.tokens[i])} for i in f.front],
             "loss": _law_dict(f.loss_law, "A0", "alpha", negate=True),
             "n_opt": _law_dict(f.n_opt, "N0", "alpha_N"),
             "d_opt": _law_dict(f.d_opt, "D0", "alpha_D")}
        if f.hparam is not None:
            d["hparam"] = dict(f.hparam, law=_law_dict(f.hparam_law, "h0", "exponent"))
        fams[f.name] = d
    return {"table": res.table, "columns": res.columns,
            "bins": res.bins if res.bins else f"default: max({MIN_BINS}, points // 3) per family",
            "rows_used": res.rows_used, "configurations": res.configs,
            "rows_skipped": res.rows_skipped, "form": "E + A0*C^-alpha" if res.irreducible else "A0*C^-alpha",
            "intervals": f"bootstrap ({res.bootstrap} resamples, percentiles)" if res.bootstrap
            else "delta method, t quantile with n-p dof", "level": LEVEL, "families": fams, "ztests": res.ztests}


def _number(v: float) -> str:
    """A fitted number as the report prints it (4 significant digits)."""
    return f"{v:.4g}"


def _with_interval(d: dict) -> str:
    """A fitted constant with its 95% interval: ``value [lo, hi]``."""
    return f"{_number(d['value'])} [{_number(d['lo'])}, {_number(d['hi'])}]"


def to_markdown(res: FitResult) -> str:
    """The fit report as markdown (the same numbers as ``to_json``)."""
    j = to_json(res)
    c = res.columns
    lines = [f"# Scaling-law fit of `{res.table}`", "",
             f"Loss `{c['loss']}` against compute `{c['compute']}`; {res.rows_used} rows used "
             f"({res.rows_skipped['not done']} not done, {res.rows_skipped['missing values']} with missing values "
             f"skipped), {res.configs} configurations after averaging seeds; minimum loss per log-spaced compute "
             f"bin (bins per family below); fits in log space; "
             f"95% intervals: {j['intervals']}.", "",
             f"## Loss: L(C) = {j['form'].replace('*', '·')}", ""]
    head = "| family | points | bins | frontier | A0 | alpha |" + (" E |" if res.irreducible else "") + " rmse (log) |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, f in j["families"].items():
        lo = f["loss"]
        lines.append(f"| {name} | {f['points']} | {f['bins']} | {len(f['frontier'])} | {_with_interval(lo['A0'])} | "
                     f"{_with_interval(lo['alpha'])} |"
                     + (f" {_with_interval(lo['E'])} |" if res.irreducible else "") + f" {lo['rmse_log']:.3g} |")
    lines += ["", "## Compute-optimal allocation: N_opt(C) = N0·C^alpha_N, D_opt(C) = D0·C^alpha_D", "",
              "| family | N0 | alpha_N | D0 | alpha_D |", "|---|---|---|---|---|"]
    for name, f in j["families"].items():
        lines.append(f"| {name} | {_with_interval(f['n_opt']['N0'])} | {_with_interval(f['n_opt']['alpha_N'])} | "
                     f"{_with_interval(f['d_opt']['D0'])} | {_with_interval(f['d_opt']['alpha_D'])} |")
    exact = [f"{name} {what}" for name, f in j["families"].items() for what in ("n_opt", "d_opt")
             if f[what]["rmse_log"] < 1e-9]
    if exact:
        lines += ["", f"Exact fits ({', '.join(exact)}): the frontier points lie on one power law by construction "
                  "(e.g. all at the same tokens per parameter), so the exponent is set by the sweep's design and "
                  "its zero-width interval carries no information."]
    if res.ztests:
        lines += ["", "## Equal exponents (two-sided z-test)", "", "| a | b | exponent | abs diff | z | p |",
                  "|---|---|---|---|---|---|"]
        for t in res.ztests:
            lines.append(f"| {t['a']} | {t['b']} | {t['exponent']} | {t['diff']:.4g} | {t['z']:.3f} | {t['p']:.4f} |")
    if c["hparam"]:
        lines += ["", f"## Optimum of `{c['hparam']}` per size: h_opt(N) = h0·N^exponent", ""]
        for name, f in j["families"].items():
            h = f["hparam"]
            lines += [f"**{name}**: h0 = {_with_interval(h['law']['h0'])}, exponent = {_with_interval(h['law']['exponent'])}", "",
                      "| params | optimum | loss | values | how |", "|---|---|---|---|---|"]
            lines += [f"| {_number(r['params'])} | {_number(r['optimum'])} | {r['loss']:.4f} | {r['values']} | {r['how']} |"
                      for r in h["sizes"]]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"
