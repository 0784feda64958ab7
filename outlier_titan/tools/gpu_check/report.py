"""The markdown report of a part."""

from __future__ import annotations


def _cell(v, spec: str = "{:.3g}") -> str:
    """A table cell: ``v`` formatted by ``spec``, "-" where there is no number."""
    return "-" if v is None else spec.format(v)


def markdown(report: dict) -> str:
    env = report["env"]
    dev = ", ".join(d["name"] for d in env.get("devices", [])) or "CPU (no CUDA device)"
    dry = " (dry run: CPU, tiny shapes; no GPU numbers)" if report["dry"] else ""
    lines = [f"## GPU check, part {report['part']}{dry}",
             "", f"- Date: {env['date']}", f"- Device: {dev}; {env['cpus']} CPUs",
             f"- torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, Python {env['python']}"
             f" (pyproject asks {env['required_torch']}"
             f"{'' if env.get('torch_meets_requirement') in (True, None) else ': not met, the device torch ran'})",
             f"- Commit: {env['commit']}",
             f"- Command: `{report['command']}`", ""]
    if env["missing_modules"] or env["import_failures"]:
        lines += [f"- Missing modules: {', '.join(env['missing_modules']) or 'none'}; modules that failed to "
                  f"import: {', '.join(env['import_failures']) or 'none'}", ""]
    if report["dry"]:
        problems = report.get("plan_problems") or []
        lines += [f"- The device plan (settings, meta-device models, tile plans): "
                  f"{'; '.join(problems) if problems else 'every item builds'}", ""]
    if report.get("tests"):
        t = report["tests"]
        lines += [f"`pytest -m gpu`: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped in {t['seconds']:.0f} s (exit {t['returncode']})", ""]
    items = report["items"]
    by_kind: dict[str, list[dict]] = {}
    for it in items:
        by_kind.setdefault(it["kind"], []).append(it)
    for kind, rows in by_kind.items():
        lines += _table(kind, rows, items) + [""]
    return "\n".join(lines) + "\n"


def _status(it: dict) -> str:
    return "ok" if it["status"] == "ok" else f"{it['status']}: {it['result'].get('error', '')[:200]}"


def _table(kind: str, rows: list[dict], items: list[dict]) -> list[str]:
    if kind == "train":
        out = ["| run | params | tokens/step | step | tokens/s | MFU | peak memory | loss first / last | status |",
               "|---|---|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            out.append(f"| {it['name']} | {_cell(r.get('params'), '{:,}')} | {_cell(r.get('tokens_per_step'), '{:,}')} | "
                       f"{_cell(r.get('step_s'), '{:.3f} s')} | {_cell(r.get('tokens_per_s'), '{:,.0f}')} | "
                       f"{_cell(r.get('mfu_pct'), '{:.1f} %')} | {_cell(r.get('peak_memory_gib'), '{:.1f} GiB')} | "
                       f"{_cell(r.get('loss_first'), '{:.3f}')} / {_cell(r.get('loss_last'), '{:.3f}')} | "
                       f"{_status(it)} |")
        return out
    if kind == "optim":
        ref = next((it["result"] for it in items if it["kind"] == "optim" and it["item"]["optimizer"] == "adamw"
                    and it["status"] == "ok"), None)
        out = ["| optimizer | optimizer step | / AdamW step | whole step | / AdamW whole step | status |",
               "|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            o, s = r.get("optimizer_step_s"), r.get("step_s")
            out.append(f"| {it['item']['optimizer']} | {_cell(o and o * 1e3, '{:.1f} ms')} | "
                       f"{_cell(o / ref['optimizer_step_s'] if o and ref else None, '{:.2f}x')} | "
                       f"{_cell(s, '{:.3f} s')} | {_cell(s / ref['step_s'] if s and ref else None, '{:.3f}x')} | "
                       f"{_status(it)} |")
        return out
    if kind == "probe":
        out = ["| run | step | probe | first probe | first step after it | throughput drop at every N | status |",
               "|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            out.append(f"| {it['name']} | {_cell(r.get('step_s'), '{:.3f} s')} | {_cell(r.get('probe_s'), '{:.3f} s')} | "
                       f"{_cell(r.get('first_probe_s'), '{:.2f} s')} | "
                       f"{_cell(r.get('first_step_after_probe_s'), '{:.2f} s')} | "
                       f"{_cell(r.get('overhead_pct'), '{:.2f} %')} | {_status(it)} |")
        return out
    if kind == "attention":
        out = ["| variant | shape | dtype | path (SDPA kernels) | fwd+bwd | tokens/s | attention core TFLOP/s | "
               "top kernels (share of kernel time) | status |", "|---|---|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            top = "; ".join(f"{name[:60]} {share:.0%}" for name, share in r.get("top_kernels", [])) or "-"
            out.append(f"| {it['item']['variant']} | {r.get('shape', '-')} | {r.get('dtype', '-')} | "
                       f"{r.get('path', '-')} | "
                       f"{_cell(r.get('fwd_bwd_s') and r['fwd_bwd_s'] * 1e3, '{:.2f} ms')} | "
                       f"{_cell(r.get('tokens_per_s'), '{:,.0f}')} | {_cell(r.get('attention_core_tflops'), '{:.1f}')} | "
                       f"{top.replace('|', '/')} | {_status(it)} |")
        return out
    if kind == "memory":
        out = ["| run | layout | params | this rank's params (planner's) | planned memory | measured peak | "
               "measured / planned | step | status |", "|---|---|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            mine = (f"{r['local_params']:,} ({r['planned_local_params']:,})" if r else "-")
            world = f", fake world of {r['world_size']}" if r.get("fake") else ""
            out.append(f"| {it['name']} | {r.get('layout', '-')}{world} | {_cell(r.get('params'), '{:,}')} | {mine} | "
                       f"{_cell(r.get('planned_gib'), '{:.1f} GiB')} | {_cell(r.get('peak_memory_gib'), '{:.1f} GiB')} | "
                       f"{_cell(r.get('measured_over_planned'), '{:.2f}')} | {_cell(r.get('step_s'), '{:.3f} s')} | "
                       f"{_status(it)} |")
        return out
    return ["| item | seconds | status |", "|---|---|---|"] + [f"| {it['name']} | {it['seconds']:.1f} | {_status(it)} |"
                                                              for it in rows]

