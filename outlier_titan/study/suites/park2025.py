"""Park et al. 2025 (arXiv 2506.19697; ACL 2025), Outlier-Safe Pre-Training: the paper's numbers, the OSP columns
derived from each evaluation, and the claims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outlier_titan.study import rules
from outlier_titan.study.groups import first_match
from outlier_titan.study.rules import Claim
from outlier_titan.study.suites.base import PTQ_THRESHOLDS, PaperRow, Suite, SuiteInfo


# Park et al. 2025 (arXiv 2506.19697): the abstract's excess kurtosis 0.04 (OSP) against 1818.56 (Adam), and the
# ablation rows of the 1.4B models trained on 100B tokens as the authors' repository (dmis-lab/
# Outlier-Safe-Pre-Training, README "Ablation Models") lists them: excess kurtosis as their evaluate_kurtosis.py
# computes it, and the 4-4-4 (W4A4KV4) perplexity without Hadamard rotation. Our rows are selected by job.name.
INFO = SuiteInfo(
    title="park2025: Outlier-Safe Pre-Training (Muon, single-scale RMSNorm, embedding projection) against outliers",
    citation="Park et al., Outlier-Safe Pre-Training for Robust 4-Bit Quantization of Large Language Models, ACL "
             "2025 (arXiv 2506.19697)",
    metrics={"final_val_loss": "val loss", "ppl": "PPL", "osp_kurtosis": "excess kurtosis (OSP script)",
             "kurtosis_neuron_rms": "kurtosis (neuron RMS, final)", "ppl_w4a4kv4_rtn": "PPL W4A4KV4 RTN",
             "d_w4a4kv4_rtn": "Δppl W4A4KV4 RTN", "d_w4a4kv4_rtn_hadamard": "Δppl W4A4KV4 RTN + Hadamard"},
    rows=[
        PaperRow("1.4B, 100B tokens, Adam", {"job.name": "adam"}, dict(osp_kurtosis=1818.56, ppl_w4a4kv4_rtn=8e4),
                 "abstract; repository README ablation table"),
        PaperRow("1.4B, 100B tokens, Muon", {"job.name": "muon"}, dict(osp_kurtosis=1575.12, ppl_w4a4kv4_rtn=1e4),
                 "repository README ablation table"),
        PaperRow("1.4B, 100B tokens, Muon + SSNorm", {"job.name": "muon_ssnorm"},
                 dict(osp_kurtosis=66.69, ppl_w4a4kv4_rtn=44.2), "repository README ablation table"),
        PaperRow("1.4B, 100B tokens, Muon + SSNorm + EmbProj (OSP)", {"job.name": "osp"},
                 dict(osp_kurtosis=0.04, ppl_w4a4kv4_rtn=19.6), "abstract; repository README ablation table"),
    ],
    schemes=("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard"),
    kurtosis="kurtosis_neuron_rms",
    extra_probe=("kurtosis_rest",),
)
def add_osp_metrics(rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """park2025's own columns (in place): the OSP script's excess kurtosis of the evaluation, and per 4-bit scheme
    its Δppl and quantised PPL (the paper prints the quantised PPL)."""
    for r in rows:
        r["osp_kurtosis"] = r.get("eval_osp_kurtosis")
        for scheme in ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard"):
            d = r.get(f"ptq_delta_ppl_{scheme}")
            r[f"d_{scheme}"] = d
            r[f"ppl_{scheme}"] = r["ppl"] + d if d is not None and r.get("ppl") is not None else None


def _parity(text: str, base: dict | None, other: dict | None) -> Claim:
    return (text, *rules.loss_cost(base, other))


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """Park et al. 2025's claims on the suite's settings (selected by ``job.name``): the OSP recipe removes the
    kurtosis Adam grows (both measures), SSNorm and EmbProj each take a step of it, its 4-bit damage is small
    against Adam's, at Adam's loss; and MuonBP's claim that block steps with periodic full ones keep full Muon's
    loss (Khaled et al. 2025)."""
    g = {name: first_match(groups, {"job.name": name}) for name in ("adam", "muon", "muon_ssnorm", "osp",
                                                                 "osp_block_periodic")}
    k, cost = f"{rules.REDUCTION_FACTOR.value:g}", f"{rules.LOSS_COST.value:.0%}"
    return [
        rules.reduction(f"excess kurtosis (OSP script): Adam ≥ {k}× the OSP recipe's (Muon + SSNorm + EmbProj)",
                        g["adam"], g["osp"], "osp_kurtosis"),
        rules.reduction(f"neuron-RMS kurtosis (final): Adam ≥ {k}× the OSP recipe's", g["adam"], g["osp"],
                        "kurtosis_neuron_rms"),
        rules.reduction(f"SSNorm's step (OSP script's kurtosis): Muon ≥ {k}× Muon + SSNorm", g["muon"],
                        g["muon_ssnorm"], "osp_kurtosis"),
        rules.reduction(f"EmbProj's step (OSP script's kurtosis): Muon + SSNorm ≥ {k}× Muon + SSNorm + EmbProj",
                        g["muon_ssnorm"], g["osp"], "osp_kurtosis"),
        rules.ptq_reduction("W4A4KV4 RTN Δppl of the OSP recipe below a third of Adam's", g["adam"], g["osp"],
                            "d_w4a4kv4_rtn"),
        rules.ptq_reduction("W4A4KV4 RTN + Hadamard (QuaRot) Δppl of the OSP recipe below a third of Adam's",
                            g["adam"], g["osp"], "d_w4a4kv4_rtn_hadamard"),
        _parity(f"the OSP recipe's val loss at most {cost} above Adam's", g["adam"], g["osp"]),
        _parity(f"MuonBP: block_periodic Muon's val loss at most {cost} above full Muon's (OSP recipe; Khaled et "
                f"al. 2025)", g["osp"], g["osp_block_periodic"]),
    ]


SUITE = Suite(INFO, claims, [rules.REDUCTION_FACTOR, rules.GAUSSIAN_EXCESS_KURTOSIS, rules.GAUSSIAN_KURTOSIS,
                             rules.LOSS_COST, *PTQ_THRESHOLDS], add_metrics=add_osp_metrics)
