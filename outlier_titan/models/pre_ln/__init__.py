"""The ``pre_ln`` spec: Pre-LN GPT-2 / Llama with softmax-1, single-scale RMSNorm and QK-norm (GPT+) options. Its
options, flavors and entry; the model is in :mod:`outlier_titan.models.pre_ln.model`."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.smooth_swiglu import SmoothSwiGLUOptions
from outlier_titan.models.spec import ModelSpec, TPPlan, register_spec
from outlier_titan.models.value_path import VALUE_PATH_TP, ValuePathOptions
from outlier_titan.options import opt

NORMS = ("layernorm", "rmsnorm", "rmsnorm_single", "rmsnorm_nogain")


@dataclass
class PreLNOptions(ValuePathOptions, SmoothSwiGLUOptions):
    norm: str = opt("layernorm", "Norm type (rmsnorm_single: one scalar gain, Kaul et al. 2024's RMSNormSingle; "
                                 "rmsnorm_nogain: no gain).", NORMS)
    embed_proj: bool = opt(False, "Outlier-Safe Pre-Training's embedding projection (Park et al. 2025): learnable d x d "
                                  "projections after the token embedding and (embed_proj_head) between the final "
                                  "norm and the head; merged into the embedding and the head on export.")
    embed_proj_head: bool = opt(True, "With model.embed_proj: also the projection before the head, as the released "
                                      "OSP code has it (false: only the one after the embedding, a variant).")
    embed_proj_init: str = opt("orthogonal", "With model.embed_proj: the projections' initialisation, a random "
                                             "orthogonal matrix as the released OSP code (identity: a variant).",
                               ("orthogonal", "identity"))


GPT2 = dict(norm="layernorm", pos_encoding="learned", bias=True, mlp="gelu", tie_embeddings=True)
LLAMA = dict(norm="rmsnorm", pos_encoding="rope", bias=False, mlp="swiglu", tie_embeddings=False,
             norm_eps=1e-5, rope_theta=500000.0)

# Kaul et al. 2024 (softmax-1 / OrthoAdam): RMSNormSingle everywhere and no biases; softmax is the per-run switch.
KAUL2024_GPT2 = dict(GPT2, norm="rmsnorm_single", bias=False, norm_eps=1e-5)
KAUL2024_LLAMA2 = dict(LLAMA, norm="rmsnorm_single", bias=False, norm_eps=1e-6, rope_theta=10000.0)
# Franke et al. 2025's GPT+ baseline (Table F.1 / F.2).
GPTPLUS = dict(norm="rmsnorm", pos_encoding="rope", rope_fraction=0.5, bias=False, mlp="swiglu",
               tie_embeddings=False, qk_norm=True, norm_eps=1e-6, rope_theta=10000.0, vocab_size=50304)

FLAVORS = {
    "debug": dict(GPT2, dim=128, n_layers=4, n_heads=4),
    "debug_llama": dict(LLAMA, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, rope_theta=10000.0),
    # GPT-2 family (Radford et al. 2019 shapes; vocab follows the tokenizer unless model.vocab_size is set)
    "gpt2_124m": dict(GPT2, dim=768, n_layers=12, n_heads=12),
    "gpt2_350m": dict(GPT2, dim=1024, n_layers=24, n_heads=16),
    "gpt2_774m": dict(GPT2, dim=1280, n_layers=36, n_heads=20),
    "gpt2_1.4b": dict(GPT2, dim=1600, n_layers=48, n_heads=25),
    # Llama 3.2 1B shape
    "llama_1b": dict(LLAMA, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192),
    # Llama 3.2 3B shape
    "llama_3b": dict(LLAMA, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192),
    # Llama 2 7B shape (multi-head attention, SwiGLU 11008)
    "llama_7b": dict(LLAMA, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008),
    # Kaul et al. 2024 (dims chosen here, see the module docstring)
    "kaul2024_gpt2_60m": dict(KAUL2024_GPT2, dim=512, n_layers=11, n_heads=8),
    "kaul2024_gpt2_130m": dict(KAUL2024_GPT2, dim=768, n_layers=12, n_heads=12),
    "kaul2024_gpt2_350m": dict(KAUL2024_GPT2, dim=1024, n_layers=24, n_heads=16),
    "kaul2024_gpt2_1.4b": dict(KAUL2024_GPT2, dim=1536, n_layers=48, n_heads=24),
    "kaul2024_llama2_130m": dict(KAUL2024_LLAMA2, dim=768, n_layers=12, n_heads=12, ffn_hidden=2048),
    # Franke et al. 2025 GPT+ (Table F.1: d_h = 64, SwiGLU 4*d per branch, vocab 50,304)
    "gptplus_32m": dict(GPTPLUS, dim=256, n_layers=6, n_heads=4, ffn_hidden=1024),
    "gptplus_62m": dict(GPTPLUS, dim=384, n_layers=10, n_heads=6, ffn_hidden=1536),
    "gptplus_125m": dict(GPTPLUS, dim=512, n_layers=18, n_heads=8, ffn_hidden=2048),
    "gptplus_250m": dict(GPTPLUS, dim=768, n_layers=18, n_heads=12, ffn_hidden=3072),
    "gptplus_0.5b": dict(GPTPLUS, dim=1024, n_layers=24, n_heads=16, ffn_hidden=4096),
    "gptplus_1b": dict(GPTPLUS, dim=1280, n_layers=36, n_heads=20, ffn_hidden=5120),
}






def _tp_unsupported(args) -> str | None:
    if args.embed_proj:
        return "model.embed_proj has no tensor-parallel plan; train it with parallelism.tp = 1 (FSDP / HSDP)"
    return None


SPEC = register_spec(ModelSpec(
    name="pre_ln",
    model="outlier_titan.models.pre_ln.model:PreLNTransformer",
    args="outlier_titan.models.pre_ln.model:PreLNArgs",
    options=PreLNOptions,
    flavors=FLAVORS,
    flavor_aliases={f"seed000_{n[len('kaul2024_'):]}": n for n in FLAVORS if n.startswith("kaul2024_")},
    # V-scale's theta [n_kv_heads] and the head norm's gain [n_heads * head_dim] are laid out like wv's / wo's heads
    tp_plan=TPPlan(loss_parallel=True, unsupported=_tp_unsupported,
                   extra=VALUE_PATH_TP),
    hf_adapter="outlier_titan.hf.adapters:adapter_for_args",
    rotation=None,
    description="Pre-LN GPT-2 / Llama with softmax-1, single-scale RMSNorm and QK-norm (GPT+) options",
))
