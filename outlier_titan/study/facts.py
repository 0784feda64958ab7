"""What a suite report's header states about its runs, so a reader can judge the scale of every verdict: the
corpus (name, size in tokens, hash), tokenizer, model shape and parameters, steps, tokens, batch, learning rates
and schedule and how the lr was chosen, seeds, the code that trained and evaluated the points, the Python and
torch versions, and which points lack a clean record (trained or evaluated by uncommitted code, or unrecorded).

Everything is read from the points' own records: each run's resolved ``config.toml``, its ``sweep_state.json``
(``code``, ``versions``, ``corpus`` per attempt) and its evaluation report (``code``, ``python``, ``torch``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from outlier_titan.config.manager import tomllib
from outlier_titan.provenance import uncommitted
from outlier_titan.study.groups import finished
from outlier_titan.study.plan import fmt_count, point_dir


def _configs(sweep_dir: Path, rows: list[dict[str, Any]], manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each finished point's resolved config (the manifest's where the run folder has none)."""
    planned = {e["name"]: e["config"] for e in manifest["points"]}
    out = {}
    for r in finished(rows):
        path = point_dir(sweep_dir, r["point"]) / "config.toml"
        out[r["point"]] = tomllib.loads(path.read_text() if path.is_file() else planned[r["point"]])
    return out


def _states(sweep_dir: Path, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    from outlier_titan.study.runner import read_state

    return {r["point"]: read_state(point_dir(sweep_dir, r["point"])) for r in finished(rows)}


def _plural(n, noun: str) -> str:
    """``1 layer``, ``4 layers``."""
    return f"{n} {noun}{'s' * (n != 1)}"


def _counted(values: list[str]) -> str:
    """``a (3 points), b (1 point)``."""
    return ", ".join(f"{v} ({_plural(n, 'point')})" for v, n in Counter(values).items())


def corpus_tokens(tokenizer_spec: str) -> int | None:
    """Tokens of this interpreter's embedded corpus (training and validation splits) with ``tokenizer_spec``, as
    the trainer's token cache holds them (built there if missing: the same arrays a run on this machine reads)."""
    from outlier_titan.data.loader import cache_root, token_cache
    from outlier_titan.data.sources import embedded_corpus
    from outlier_titan.data.tokenizer import build_tokenizer
    from outlier_titan.errors import DataError

    try:
        tok = build_tokenizer(tokenizer_spec)
        return sum(token_cache(embedded_corpus(split), tok, cache_root())[1].get("tokens", 0)
                   for split in ("train", "validation")) or None
    except DataError:  # a tokenizer this machine cannot build, or no writable cache: the header says less
        return None


def corpus_line(configs: dict[str, dict[str, Any]], states: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(the header's corpus statement, a short name for the verdicts' scale phrase)."""
    from outlier_titan.data.sources import embedded_fingerprint

    sources = Counter(c.get("data", {}).get("source", "embedded") for c in configs.values())
    parts, short = [], []
    for source, n in sources.items():
        if source == "bigram_backcopy":
            parts.append(f"the synthetic Bigram-Backcopy task (`data.source = \"bigram_backcopy\"`, generated "
                         f"token streams, Guo et al. 2024; {n} points)")
            short.append("the synthetic Bigram-Backcopy task")
            continue
        if source != "embedded":
            parts.append(f"`{source}` ({n} points)")
            short.append(f"`{source}`")
            continue
        recorded = [s["corpus"][-1] for p, s in states.items() if s.get("corpus")
                    and configs[p].get("data", {}).get("source", "embedded") == "embedded"]
        here = embedded_fingerprint()
        tokenizer = next(iter(configs.values())).get("data", {}).get("tokenizer", "embedded")
        tokens = corpus_tokens(tokenizer)
        size = lambda fp: (f"{fp['files']:,} `.py` files, {fp['bytes'] / 1e6:.1f} MB, SHA-256 "  # noqa: E731
                           f"{fp['sha256']}")
        if recorded and len(recorded) == n and len({r["sha256"] for r in recorded}) == 1:
            fp = recorded[0]
            text = f"the Python {fp['python']} standard library source (the embedded corpus: {size(fp)}"
            if fp["sha256"] == here["sha256"] and tokens:
                text += f"; {fmt_count(tokens)} tokens with the run's tokenizer"
            parts.append(text + ")")
            short.append(f"Python {fp['python']} standard-library source")
        else:
            unrec = n - len(recorded)
            parts.append(f"the Python standard library source of the interpreter that trained (the embedded corpus; "
                         f"which Python is not recorded for {unrec} of {n} points; this project's machines ran "
                         f"Python {here['python']}, whose standard library is {size(here)}"
                         + (f", {fmt_count(tokens)} tokens with the run's tokenizer" if tokens else "") + ")")
            short.append("Python standard-library source")
    return "; ".join(parts), " and ".join(dict.fromkeys(short))


def _model_line(configs: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(the models' shapes with parameter counts, the parameter range for the scale phrase)."""
    params = {r["point"]: r.get("params") for r in finished(rows)}
    shapes: dict[str, list[int]] = {}
    for point, c in configs.items():
        m = c.get("model", {})
        shape = (f"{m.get('name')}" + (f" ({m.get('block')} block)" if m.get("block") and m.get("block") !=
                                       m.get("name") else "")
                 + f", {_plural(m.get('n_layers'), 'layer')} × width {m.get('dim')}, "
                   f"{_plural(m.get('n_heads'), 'head')}")
        if params.get(point):
            shapes.setdefault(shape, []).append(params[point])
    line = "; ".join(f"{s}: {_span(p)} parameters" for s, p in shapes.items())
    every = [p for ps in shapes.values() for p in ps]
    return line, _span(every) if every else "?"


def _span(values: list[float]) -> str:
    """``1.2M`` or ``1.2M–3.4M`` (one number where both ends print alike)."""
    lo, hi = fmt_count(min(values)), fmt_count(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _training_line(configs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(steps, batch, tokens, schedule and learning rates; the tokens per point for the scale phrase)."""
    runs = Counter()
    lrs: dict[str, set] = {}
    for c in configs.values():
        t, s, o = c.get("training", {}), c.get("lr_scheduler", {}), c.get("optimizer", {})
        tokens = t.get("steps", 0) * t.get("global_batch_size", 0) * t.get("seq_len", 0)
        runs[(t.get("steps"), t.get("global_batch_size"), t.get("seq_len"), tokens, s.get("warmup_steps"),
              s.get("decay"), s.get("decay_ratio"), s.get("min_lr_ratio"))] += 1
        lrs.setdefault(o.get("name"), set()).add(o.get("lr"))
    parts = []
    for (steps, batch, seq, tokens, warm, decay, ratio, floor), n in runs.items():
        parts.append(f"{steps} steps × {batch} sequences × {seq} tokens = {fmt_count(tokens)} tokens a point "
                     f"(warm-up {warm} steps, then {decay} decay over the last {ratio:.0%} of the steps to "
                     f"{floor:g} × the peak lr; {n} points)" if isinstance(ratio, (int, float)) else
                     f"{steps} steps × {batch} × {seq} = {fmt_count(tokens)} tokens a point ({n} points)")
    lr = "; ".join(f"{name} {', '.join(f'{v:g}' for v in sorted(v for v in vals if v is not None))}"
                   for name, vals in lrs.items())
    return "; ".join(parts) + f". Peak learning rates: {lr}", _span([k[3] for k in runs])


def _versions(states: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    trained = [f"Python {v['python']}, torch {v['torch']}" for s in states.values() for v in s.get("versions", [])]
    missing = sum(not s.get("versions") for s in states.values())
    evaluated = [r["eval_versions"] for r in finished(rows) if r.get("eval_versions")]
    eval_missing = sum(1 for r in finished(rows) if "eval_code" in r and not r.get("eval_versions"))
    text = "training: " + (_counted(trained) if trained else "not recorded")
    text += f"; not recorded for {missing} point{'s' * (missing != 1)}" if missing and trained else ""
    text += "; evaluation: " + (_counted(evaluated) if evaluated else "not recorded")
    text += f"; not recorded for {eval_missing} point{'s' * (eval_missing != 1)}" if eval_missing and evaluated else ""
    return text + " (versions are recorded since 2026-11-28)"


def provenance_flags(states: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """The header's warning on points without a clean record, or ""."""
    dirty = sorted(p for p, s in states.items() if any(map(uncommitted, s.get("code", []))))
    unrecorded = sorted(p for p, s in states.items() if not s.get("code"))
    eval_dirty = sorted(r["point"] for r in finished(rows) if uncommitted(r.get("eval_code")))
    eval_unrecorded = sorted(r["point"] for r in finished(rows) if r.get("eval_code") == "")
    parts = []
    for what, points in (("trained by uncommitted (`+dirty`) code", dirty), ("without a record of the code that "
                         "trained them", unrecorded), ("evaluated by uncommitted code", eval_dirty),
                         ("without a record of the code that evaluated them", eval_unrecorded)):
        if points:
            parts.append(f"{len(points)} point{'s' * (len(points) != 1)} {what}")
    if not parts:
        return ""
    return ("**Provenance:** " + "; ".join(parts) + ". Their numbers cannot be traced to a commit; they are to be "
            "re-run from committed code before this report is quoted.")


def header(sweep_dir: Path, manifest: dict[str, Any], rows: list[dict[str, Any]], seeds: list, lr_choice: str,
           out: Path) -> tuple[list[str], str]:
    """(the report's "Runs" section, the scale phrase every verdict carries, e.g. "at 4.2M parameters and 819k
    tokens a point of Python 3.11.7 standard-library source")."""
    configs, states = _configs(sweep_dir, rows, manifest), _states(sweep_dir, rows)
    if not configs:
        return [], "at this scale"
    corpus, corpus_short = corpus_line(configs, states)
    models, params = _model_line(configs, rows)
    training, tokens = _training_line(configs)
    tokenizers = Counter(c.get("data", {}).get("tokenizer", "embedded") for c in configs.values())
    vocab = sorted({r.get("vocab_size") for r in rows if r.get("vocab_size")})
    lines = ["## Runs", "",
             f"- **Corpus**: {corpus}.",
             f"- **Tokenizer**: {', '.join(f'`{t}`' for t in tokenizers)}"
             + (" (the 4,096-token BPE shipped with the package, trained on the same standard library)"
                if "embedded" in tokenizers else "") + (f"; vocabulary {vocab}" if vocab else "") + ".",
             f"- **Models**: {models}.",
             f"- **Training**: {training}.",
             f"- **How the learning rate was chosen**: {lr_choice or 'not stated by the suite file'}.",
             f"- **Seeds**: {seeds}.",
             f"- **Code**: {trained_by(sweep_dir, rows, out)}{evaluated_by(rows)}{evaluation_updates(rows)}",
             f"- **Versions**: {_versions(states, rows)}.", ""]
    flags = provenance_flags(states, rows)
    if flags:
        lines += [flags, ""]
    return lines, f"at {params} parameters and {tokens} tokens a point of {corpus_short}"


def trained_by(sweep_dir: Path, rows: list[dict[str, Any]], own: Path | None = None) -> str:
    """The report's sentence on the code that trained the finished points (``code`` of each ``sweep_state.json``;
    a point still running or interrupted is not counted) and on the points adopted from other report folders
    (``own``: the report's own folder, whose points a re-rendering adopts back, is not named as a source)."""
    from outlier_titan.study.runner import read_state

    codes: dict[str, int] = {}
    adopted: dict[str, list[tuple[str, str]]] = {}  # report folder -> (our point, its name there)
    missing = several = 0
    for r in finished(rows):
        state = read_state(point_dir(sweep_dir, r["point"]))
        recorded = state.get("code", [])
        missing += not recorded
        several += len(set(recorded)) > 1
        for c in recorded:
            codes[c] = codes.get(c, 0) + 1
        if state.get("adopted_from") and (own is None or Path(state["adopted_from"]).resolve() != own.resolve()):
            adopted.setdefault(state["adopted_from"], []).append((r["point"], state.get("adopted_point", r["point"])))
    took = ""
    for src, pairs in adopted.items():
        renamed = [f"{ours} = {theirs}" for ours, theirs in pairs if ours != theirs]
        # a folder outside the repository (a scratch copy on the machine that ran it) is named, not its path
        where = f"`{src}`" if not Path(src).is_absolute() else f"`{Path(src).name}`, outside the repository"
        took += (f" {len(pairs)} point{'s were' if len(pairs) != 1 else ' was'} trained and evaluated by an earlier "
                 f"run and adopted from its report folder {where} (`--adopt`"
                 + (f"; under another name there: {', '.join(renamed)}" if renamed else "") + ").")
    if not codes:
        return "the code that trained the points is not recorded in their `sweep_state.json`." + took
    parts = [f"{c} ({n} point{'s' * (n != 1)})" for c, n in codes.items()]
    return ("points trained at code " + ", ".join(parts)
            + (f" ({several} point{'s' * (several != 1)} resumed at other code, counted under each)" if several else "")
            + (f"; {missing} point{'s' * (missing != 1)} without a record" if missing else "") + "." + took)


def evaluated_by(rows: list[dict[str, Any]]) -> str:
    """The report's sentence on the code that evaluated the finished points (``code`` of each evaluation report,
    carried as ``eval_code``), or "" when none was evaluated."""
    evaluated = [r for r in finished(rows) if "eval_code" in r]
    codes = Counter(r["eval_code"] for r in evaluated if r["eval_code"])
    missing = len(evaluated) - sum(codes.values())
    parts = [f"{c} ({n} point{'s' * (n != 1)})" for c, n in codes.items()]
    if missing:
        parts.append(f"not recorded for {missing} point{'s' * (missing != 1)} (evaluated before evaluation "
                     f"reports recorded their code, 2026-11-28)")
    return f" Evaluated at code {', '.join(parts)}." if parts else ""


def evaluation_updates(rows: list[dict[str, Any]]) -> str:
    """The report's sentence on schemes re-run into the points' evaluation reports after the evaluation
    (``scripts/evaluate.py --update``: the ``eval_updated`` stamps :func:`results.point_row` carries), or ""."""
    runs: dict[tuple, list[str]] = {}  # (schemes re-run together, code) -> the dates, one per point
    for r in rows:
        for u in r.get("eval_updated") or []:
            runs.setdefault((tuple(u["schemes"]), u.get("code")), []).append(u["at"][:10])
    parts = [f"{', '.join(schemes)} on {len(dates)} point{'s' * (len(dates) != 1)} "
             f"({min(dates)}{' to ' + max(dates) if max(dates) != min(dates) else ''}, "
             f"{'at code ' + code if code else 'code not recorded'})"
             for (schemes, code), dates in runs.items()]
    return (" Re-run into the evaluation reports afterwards (`scripts/evaluate.py --update`): "
            + "; ".join(parts) + ".") if parts else ""


