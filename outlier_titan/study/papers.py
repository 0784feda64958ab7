"""The papers' numbers that the reproduction suites put beside ours, transcribed from the papers.

Each :class:`PaperRow` names the sweep point it corresponds to by axis values (``select``), the paper's value per
metric, and where the number is printed. Sources: Kaul et al. 2024 (arXiv 2410.17174; ICLR 2025): Tables 2,
3, 5; He et al. 2024 (arXiv 2405.19279): Table 2, OPT-125m; Franke et al. 2025 (arXiv 2505.22014): §5.2, Fig. 3,
Table 2 (our readings: docs/papers/). The model sizes differ from ours; the rows are the papers' settings that our
points mirror, not predictions of our numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PaperRow:
    label: str
    select: dict[str, object]
    paper: dict[str, float]
    source: str


FOUR_BIT_SCHEMES = ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard")
"""The 4-bit rows every suite's report adds beside its paper's own schemes: W4A4KV4 round-to-nearest and the same
after a QuaRot-style Hadamard rotation (``quant/ptq.py``). They ask whether a training-time remedy still matters
once an inference-time one is applied; only park2025's verdicts rest on them. (GPTQ + rotation is left out for
its cost: 22.1 s a run at 8,192 tokens against 6.5 s for RTN + rotation in docs/quantisation.md's table, one run per
calibration seed; ``scripts/evaluate.py --schemes`` runs it on a checkpoint.)"""


@dataclass(frozen=True)
class SuiteInfo:
    title: str
    citation: str
    metrics: dict[str, str]           # metric key -> column header (order = table order)
    rows: list[PaperRow] = field(default_factory=list)
    schemes: tuple[str, ...] = ()     # the paper's own PTQ schemes (scripts/evaluate.py --schemes): verdicts use these
    extra_schemes: tuple[str, ...] = FOUR_BIT_SCHEMES  # evaluated and tabled too, no verdict rests on them
    kurtosis: str = "kurtosis_rest"   # the probe metric of the kurtosis trajectory figure
    extra_probe: tuple[str, ...] = ()  # further probe metrics of the report's peaks table
    # the tile-size study (``--scale tiles``): the baseline's and the remedy's axes, the claim's metric (decided by
    # the rule set's reduction, study/rules.py) and the metrics plotted against the tile edge
    tile_study: tuple[dict[str, object], dict[str, object], str, tuple[str, ...]] | None = None

    @property
    def all_schemes(self) -> tuple[str, ...]:
        """Every scheme the suite's evaluation runs: the paper's, then the added ones."""
        return tuple(dict.fromkeys(self.schemes + self.extra_schemes))


def _k(opt: str, sm: str, norm: str) -> dict[str, object]:
    return {"optimizer.name": opt, "model.softmax": sm, "model.norm": norm}


KAUL = SuiteInfo(
    title="kaul2024: softmax-1 and OrthoAdam against first-token dominance and outlier activations",
    citation="Kaul et al., From Attention to Activation: Unravelling the Enigmas of Large Language Models, ICLR 2025",
    metrics={"ppl": "PPL", "kurtosis_first": "κ₁", "kurtosis_rest": "κ>₁", "max_abs_first": "A₁",
             "max_abs_rest": "A>₁", "first_share": "%First", "d_int8_coarse": "Δppl int8 coarse",
             "d_int4": "Δppl int4 zero-point"},
    rows=[
        PaperRow("GPT2 130M, Adam, softmax, RMSNorm-S", _k("adam", "softmax", "rmsnorm_single"),
                 dict(ppl=22.9, kurtosis_first=514.9, kurtosis_rest=141.5, max_abs_first=7018.1,
                      max_abs_rest=1014.8, first_share=0.527, d_int8_coarse=23.60, d_int4=657.0),
                 "Table 2 row 5, Table 3 row 3"),
        PaperRow("GPT2 130M, Adam, softmax-1, RMSNorm-S", _k("adam", "softmax1", "rmsnorm_single"),
                 dict(ppl=22.7, kurtosis_first=175.4, kurtosis_rest=144.2, max_abs_first=1134.3,
                      max_abs_rest=967.5, first_share=0.024), "Table 2 row 6"),
        PaperRow("GPT2 130M, OrthoAdam, softmax, RMSNorm-S", _k("orthoadam", "softmax", "rmsnorm_single"),
                 dict(ppl=23.1, kurtosis_first=446.4, kurtosis_rest=20.2, max_abs_first=4285.0,
                      max_abs_rest=433.4, first_share=0.424), "Table 2 row 7"),
        PaperRow("GPT2 130M, OrthoAdam, softmax-1, RMSNorm-S", _k("orthoadam", "softmax1", "rmsnorm_single"),
                 dict(ppl=22.8, kurtosis_first=10.1, kurtosis_rest=7.3, max_abs_first=318.1, max_abs_rest=261.6,
                      first_share=0.019, d_int8_coarse=0.43, d_int4=1.2), "Table 2 row 8, Table 3 row 4"),
        # Table 5 (GPT2 ~130M, 40k steps): its single kurtosis / max column does not say which layers it covers,
        # so only PPL and %First are compared
        PaperRow("GPT2 130M ablation, Adam, softmax, LayerNorm", _k("adam", "softmax", "layernorm"),
                 dict(ppl=26.9, first_share=0.308), "Table 5 row 2"),
        PaperRow("GPT2 130M ablation, Adam, softmax-1, LayerNorm", _k("adam", "softmax1", "layernorm"),
                 dict(ppl=26.5, first_share=0.022), "Table 5 row 5"),
        PaperRow("GPT2 130M ablation, OrthoAdam, softmax-1, LayerNorm", _k("orthoadam", "softmax1", "layernorm"),
                 dict(ppl=26.6, first_share=0.023), "Table 5 row 14"),
    ],
    schemes=("int8_fine", "int8_moderate", "int8_coarse", "int4_zeropoint"),
    kurtosis="kurtosis_rest",
    tile_study=({"optimizer.name": "adam"}, {"optimizer.name": "orthoadam"}, "kurtosis_rest",
                ("peak_kurtosis_rest", "kurtosis_rest", "max_abs_rest", "first_share", "d_int8_coarse", "d_int4",
                 "final_val_loss")),
)


def _h(block: str, opt: str) -> dict[str, object]:
    return {"model.block": block, "optimizer.name": opt}


HE = SuiteInfo(
    title="he2024: the Outlier Protected block and SOAP against outlier features",
    citation="He et al., Understanding and Minimising Outlier Features in Transformer Training, NeurIPS 2024",
    metrics={"ppl": "PPL", "kurtosis_neuron_rms": "kurtosis (neuron RMS, final)",
             "peak_kurtosis_neuron_rms": "kurtosis (neuron RMS, peak)", "d_w8a8": "Δppl W8A8"},
    rows=[
        PaperRow("OPT-125m, Pre-LN, AdamW (default)", _h("pre_ln", "adamw"),
                 dict(ppl=16.00, kurtosis_neuron_rms=25.6, d_w8a8=47.40), "Table 2 row 1"),
        PaperRow("OPT-125m, Pre-LN, SOAP", _h("pre_ln", "soap"),
                 dict(ppl=14.80, kurtosis_neuron_rms=5.1, d_w8a8=1.63), "Table 2 row 5"),
        PaperRow("OPT-125m, OP, AdamW (default)", _h("op", "adamw"),
                 dict(ppl=15.64, kurtosis_neuron_rms=3.6, d_w8a8=0.37), "Table 2 row 11"),
        PaperRow("OPT-125m, OP, SOAP", _h("op", "soap"),
                 dict(ppl=14.71, kurtosis_neuron_rms=1.2, d_w8a8=0.16), "Table 2 row 15"),
    ],
    schemes=("w8a8_static",),
    kurtosis="kurtosis_neuron_rms",
    tile_study=({"optimizer.name": "adamw"}, {"optimizer.name": "soap"}, "kurtosis_neuron_rms",
                ("kurtosis_neuron_rms", "peak_kurtosis_neuron_rms", "max_abs_rest", "d_w8a8", "final_val_loss")),
    extra_probe=("signal_prop_corr",),  # He et al. 2024 §2: mean input correlation tracks the kurtosis
)

FRANKE = SuiteInfo(
    title="franke2025: anGPT and nGPT against GPT+ at equal tokens",
    citation="Franke et al., Learning in Compact Spaces with Approximately Normalized Transformers, 2025",
    metrics={"final_val_loss": "final val loss", "speedup": "speed-up vs GPT+ (tokens ratio)",
             "step_time_ratio": "step time / GPT+'s"},
    rows=[
        PaperRow("0.5B, anGPT vs GPT+ (QK-norm)", {"model.name": "angpt"},
                 dict(speedup=1.4, step_time_ratio=1.0275), "§5.2 / Fig. 3 (average speed-up), Table 2"),
        PaperRow("0.5B, nGPT vs GPT+ (QK-norm)", {"model.name": "ngpt"},
                 dict(speedup=1.29), "§5.2 / Fig. 3 (average speed-up)"),
        PaperRow("0.5B, GPT+ (QK-norm)", {"model.name": "pre_ln"}, dict(speedup=1.0, step_time_ratio=1.0),
                 "the reference of both ratios"),
    ],
    schemes=("int8_fine",),
    kurtosis="kurtosis_rest",
)

# The attention-sink remedies (docs/attention.md). Paper numbers only where checked: softpick's 0 % sink rate
# (340M and 1.8B) and sigmoid attention's absence of sinks (Gu et al., up to 1B), both from the abstracts, and
# Kaul et al.'s %First (the share of (query, head) pairs whose most-attended key is the first token) of the
# four softmax / softmax-1 x Adam / OrthoAdam models of Table 2 (the same rows as the kaul2024 suite; their norm
# is single-scale RMSNorm, ours the debug model's LayerNorm).
SINKS = SuiteInfo(
    title="sinks2025: attention-sink remedies side by side (softmax-1, sink logit, gates, softpick, sigmoid, ReLU, "
          "clipped softmax)",
    citation="Zuhri et al. 2025 (arXiv 2504.20966); Gu et al. 2024 (arXiv 2410.10781); Qiu et al. 2025 (arXiv "
             "2505.06708); Ramapuram et al. 2024 (arXiv 2409.04431); Guo et al. 2024 (arXiv 2410.13835); "
             "Bondarenko et al. 2023 (arXiv 2306.12929); Kaul et al., ICLR 2025",
    metrics={"ppl": "PPL", "sink_rate": "Sink^0.3", "sink_rate_pooled": "pooled Sink^0.3",
             "first_share": "%First", "massive_ratio": "top-1 / median",
             "value_drain": "value drain", "d_int8_coarse": "Δppl int8 coarse"},
    rows=[
        PaperRow("softpick, 340M and 1.8B", {"model.attention": "softpick"}, dict(sink_rate=0.0),
                 "Zuhri et al. 2025, abstract (0 % sink rate)"),
        PaperRow("sigmoid attention without normalisation, up to 1B", {"model.attention": "sigmoid"},
                 dict(sink_rate=0.0), "Gu et al. 2024, abstract (no attention sink emerges)"),
        PaperRow("GPT2 130M, Adam, softmax (RMSNorm-S)", {"optimizer.name": "adam", "model.attention": "softmax"},
                 dict(first_share=0.527), "Kaul et al. 2024 (arXiv 2410.17174), Table 2 row 5"),
        PaperRow("GPT2 130M, Adam, softmax-1 (RMSNorm-S)", {"optimizer.name": "adam", "model.attention": "softmax1"},
                 dict(first_share=0.024), "Kaul et al. 2024, Table 2 row 6"),
        PaperRow("GPT2 130M, OrthoAdam, softmax (RMSNorm-S)",
                 {"optimizer.name": "orthoadam", "model.attention": "softmax"}, dict(first_share=0.424),
                 "Kaul et al. 2024, Table 2 row 7"),
        PaperRow("GPT2 130M, OrthoAdam, softmax-1 (RMSNorm-S)",
                 {"optimizer.name": "orthoadam", "model.attention": "softmax1"}, dict(first_share=0.019),
                 "Kaul et al. 2024, Table 2 row 8"),
    ],
    schemes=("int8_coarse",),
    kurtosis="kurtosis_rest",
    extra_probe=("sink_rate", "sink_rate_pooled", "massive_ratio", "value_drain"),
)

# --- park2025 (Outlier-Safe Pre-Training) ---
# Park et al. 2025 (arXiv 2506.19697): the abstract's excess kurtosis 0.04 (OSP) against 1818.56 (Adam), and the
# ablation rows of the 1.4B models trained on 100B tokens as the authors' repository (dmis-lab/
# Outlier-Safe-Pre-Training, README "Ablation Models") lists them: excess kurtosis as their evaluate_kurtosis.py
# computes it, and the 4-4-4 (W4A4KV4) perplexity without Hadamard rotation. Our rows are selected by job.name.
PARK = SuiteInfo(
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
# --- end park2025 ---

SUITE_INFO = {"kaul2024": KAUL, "he2024": HE, "franke2025": FRANKE, "sinks2025": SINKS,
              "park2025": PARK}
