"""Hugging Face state-dict adapters for the ``pre_ln`` spec (torchtitan's ``state_dict_adapter`` idea).

Two families, each a mapping between an HF checkpoint (``config.json`` + ``*.safetensors``) and our model:

- GPT-2 (``GPT2LMHeadModel``) <-> ``pre_ln`` GPT-2 style: HF's ``Conv1D`` stores weights as [in, out], so
  every projection is transposed; the fused ``c_attn`` is split into ``wq, wk, wv``; the head is tied unless
  ``tie_word_embeddings`` is false; ``gelu_new`` / ``gelu_pytorch_tanh`` are our tanh GELU.
- Llama (``LlamaForCausalLM``) <-> ``pre_ln`` Llama style: RMSNorm, SwiGLU (gate = w1, up = w3, down = w2),
  GQA, untied head. HF's modeling code applies RoPE with ``rotate_half``, i.e. it pairs dim i with
  i + d_h/2, which is our ``RotaryEmbedding`` layout, so q/k weights map unpermuted (the interleaved-pair
  permutation exists only between Meta's original files and HF's).

Any config option we cannot reproduce exactly is an :class:`~outlier_titan.hf.folders.HFError` naming it.
:func:`hf_model_config` turns an HF folder's ``config.json`` into our ``[model]`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from outlier_titan.config.job_config import section_class
from outlier_titan.hf.folders import HFError, read_hf_config
from outlier_titan.models.attention_variants import used_variants, uses_only

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Model


# ---------------------------------------------------------------- adapters

def _unsupported(family: str, option: str, value: Any, allowed: str) -> HFError:
    return HFError(f"HF {family} config: {option} = {value!r} is not supported (outlier_titan reproduces "
                   f"{allowed}); convert the model or pick another")


def _softmax_only(a, family: str) -> str | None:
    """None if every block of ``a`` runs plain softmax attention (all HF can hold), else why not."""
    if uses_only(a, "softmax"):
        return None
    others = ", ".join(dict.fromkeys(v for v in used_variants(a) if v != "softmax"))
    return f"attention variant {others} (HF {family} needs softmax in every block)"


def _check_shapes(family: str, got: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  ignore: tuple[str, ...] = ()) -> None:
    missing = [k for k in expected if k not in got]
    if missing:
        raise HFError(f"HF {family} weights: {len(missing)} missing, first {missing[0]!r}; the folder is "
                      f"incomplete (copy every *.safetensors shard)")
    for k, shape in expected.items():
        if tuple(got[k].shape) != tuple(shape):
            raise HFError(f"HF {family} weights: {k} has shape {tuple(got[k].shape)} but config.json implies "
                          f"{tuple(shape)}; the weights do not belong to this config")
    extra = [k for k in got if k not in expected and not k.endswith(ignore)]
    if extra:
        raise HFError(f"HF {family} weights: {len(extra)} unexpected tensor(s), first {extra[0]!r}; the "
                      f"architecture has parts outlier_titan does not model")


def _checked_tensors(family: str, t: dict[str, torch.Tensor], a, expected: dict[str, tuple[int, ...]],
                     ignore) -> dict[str, torch.Tensor]:
    """A copy of the HF tensors, without a tied head saved explicitly (it is the embedding again), shapes checked."""
    t = dict(t)
    if a.tie_embeddings:
        t.pop("lm_head.weight", None)
    _check_shapes(family, t, expected, ignore)
    return t


class _Adapter:
    """The walk both families share: the tensors outside the blocks (``_OUTER``: our name -> HF name), each
    block's (``_block_from_hf`` / ``_block_to_hf``), and the head when it is not tied."""

    family: str
    _IGNORE: tuple[str, ...]
    _OUTER: dict[str, str]

    @classmethod
    def from_hf(cls, t: dict[str, torch.Tensor], a) -> dict[str, torch.Tensor]:
        """HF tensors -> our state dict (checked against the shapes ``a`` implies)."""
        t = _checked_tensors(cls.family, t, a, cls.expected_hf_shapes(a), cls._IGNORE)
        return cls._walk(t, a, to_hf=False)

    @classmethod
    def to_hf(cls, s: dict[str, torch.Tensor], a) -> dict[str, torch.Tensor]:
        """Our state dict -> HF tensors (the tied head is not stored, as ``save_pretrained`` does)."""
        return cls._walk(s, a, to_hf=True)

    @classmethod
    def _walk(cls, src: dict[str, torch.Tensor], a, to_hf: bool) -> dict[str, torch.Tensor]:
        outer = {hf: ours for ours, hf in cls._OUTER.items()} if to_hf else cls._OUTER  # destination -> source
        block = cls._block_to_hf if to_hf else cls._block_from_hf
        head, src_head = ("lm_head.weight", "output.weight") if to_hf else ("output.weight", "lm_head.weight")
        out = {dst: src[name] for dst, name in outer.items()}
        for i in range(a.n_layers):
            out.update(block(src, i, a))
        if not a.tie_embeddings:
            out[head] = src[src_head]
        return {k: v.contiguous() for k, v in out.items()}


class GPT2Adapter(_Adapter):
    """HF ``GPT2LMHeadModel`` <-> ``pre_ln`` GPT-2 style."""

    family = "gpt2"
    _OUTER = {"tok_embeddings.weight": "transformer.wte.weight", "pos_embeddings.weight": "transformer.wpe.weight",
              "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    _ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
    # Causal-mask buffers that older transformers versions saved with the weights.
    _IGNORE = (".attn.bias", ".attn.masked_bias")

    @classmethod
    def options_from_hf(cls, c: dict[str, Any]) -> dict[str, Any]:
        """Our ``pre_ln`` options (``model.*`` keys) for an HF GPT-2 config."""
        act = c.get("activation_function", "gelu_new")
        if act not in cls._ACT:
            raise _unsupported("gpt2", "activation_function", act, "gelu_new, gelu_pytorch_tanh, relu")
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
            if c.get(key, ok) != ok:
                raise _unsupported("gpt2", key, c[key], f"{key} = {ok}")
        d, h = c["n_embd"], c["n_head"]
        return dict(dim=d, n_layers=c["n_layer"], n_heads=h, n_kv_heads=h,
                    ffn_hidden=c.get("n_inner") or 4 * d, vocab_size=c["vocab_size"], max_seq_len=c["n_positions"],
                    norm="layernorm", softmax="softmax", pos_encoding="learned", bias=True, qk_norm=False,
                    mlp=cls._ACT[act], tie_embeddings=bool(c.get("tie_word_embeddings", True)),
                    norm_eps=c.get("layer_norm_epsilon", 1e-5))

    @staticmethod
    def exportable(a) -> str | None:
        """None if ``a`` (PreLNArgs) is a GPT-2 model HF can hold, else the first option that is not."""
        want = dict(norm="layernorm", pos_encoding="learned", bias=True, qk_norm=False)
        for k, v in want.items():
            if getattr(a, k) != v:
                return f"model.{k} = {getattr(a, k)!r} (HF GPT-2 needs {v!r})"
        if (why := _softmax_only(a, "GPT-2")) is not None:
            return why
        if a.mlp not in ("gelu", "relu"):
            return f"model.mlp = {a.mlp!r} (HF GPT-2 needs gelu or relu)"
        if a.n_kv_heads != a.n_heads:
            return f"model.n_kv_heads = {a.n_kv_heads} (HF GPT-2 has no grouped-query attention)"
        return None

    @staticmethod
    def hf_config(a) -> dict[str, Any]:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": a.vocab_size,
                "n_positions": a.max_seq_len, "n_embd": a.dim, "n_layer": a.n_layers, "n_head": a.n_heads,
                "n_inner": a.ffn_hidden, "activation_function": "gelu_new" if a.mlp == "gelu" else "relu",
                "layer_norm_epsilon": a.norm_eps, "tie_word_embeddings": a.tie_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "use_cache": True}

    # (HF module, our module, weight stored as Conv1D [in, out]) in each block, besides the fused c_attn
    _BLOCK = (("ln_1", "attention_norm", False), ("attn.c_proj", "attention.wo", True), ("ln_2", "ffn_norm", False),
              ("mlp.c_fc", "feed_forward.w1", True), ("mlp.c_proj", "feed_forward.w2", True))

    @classmethod
    def _names(cls, i: int) -> list[tuple[str, str, bool]]:
        """(HF name, our name, transposed) for block i, besides the split c_attn."""
        out = []
        for hf, ours, conv in cls._BLOCK:
            out.append((f"transformer.h.{i}.{hf}.weight", f"layers.{i}.{ours}.weight", conv))
            out.append((f"transformer.h.{i}.{hf}.bias", f"layers.{i}.{ours}.bias", False))
        return out

    @classmethod
    def expected_hf_shapes(cls, a) -> dict[str, tuple[int, ...]]:
        d, f = a.dim, a.ffn_hidden
        shapes = {"transformer.wte.weight": (a.vocab_size, d), "transformer.wpe.weight": (a.max_seq_len, d),
                  "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
        for i in range(a.n_layers):
            h = f"transformer.h.{i}."
            shapes.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "ln_2.weight": (d,),
                           h + "ln_2.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d),
                           h + "attn.c_attn.bias": (3 * d,),
                           h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                           h + "mlp.c_fc.weight": (d, f), h + "mlp.c_fc.bias": (f,),
                           h + "mlp.c_proj.weight": (f, d), h + "mlp.c_proj.bias": (d,)})
        if not a.tie_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, d)
        return shapes

    @classmethod
    def _block_from_hf(cls, t: dict[str, torch.Tensor], i: int, a) -> dict[str, torch.Tensor]:
        out = {ours: t[hf].t() if transposed else t[hf] for hf, ours, transposed in cls._names(i)}
        w = t[f"transformer.h.{i}.attn.c_attn.weight"].t()
        b = t[f"transformer.h.{i}.attn.c_attn.bias"]
        for name, wp, bp in zip("qkv", w.chunk(3, 0), b.chunk(3, 0)):
            out[f"layers.{i}.attention.w{name}.weight"], out[f"layers.{i}.attention.w{name}.bias"] = wp, bp
        return out

    @classmethod
    def _block_to_hf(cls, s: dict[str, torch.Tensor], i: int, a) -> dict[str, torch.Tensor]:
        out = {hf: s[ours].t() if transposed else s[ours] for hf, ours, transposed in cls._names(i)}
        p = f"layers.{i}.attention."
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([s[p + f"w{n}.weight"] for n in "qkv"]).t()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([s[p + f"w{n}.bias"] for n in "qkv"])
        return out


class LlamaAdapter(_Adapter):
    """HF ``LlamaForCausalLM`` <-> ``pre_ln`` Llama style."""

    family = "llama"
    _OUTER = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    _IGNORE = ("rotary_emb.inv_freq",)

    @staticmethod
    def _rope_theta(c: dict[str, Any]) -> float:
        rp = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {}
        kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if kind != "default":
            raise _unsupported("llama", "rope_type", kind, "plain RoPE (rope_type 'default')")
        return float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))

    @classmethod
    def options_from_hf(cls, c: dict[str, Any]) -> dict[str, Any]:
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported("llama", "hidden_act", act, "silu (SwiGLU)")
        attn_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise _unsupported("llama", "attention_bias / mlp_bias", (attn_bias, mlp_bias), "both equal")
        d, h = c["hidden_size"], c["num_attention_heads"]
        head_dim = c.get("head_dim") or d // h
        if head_dim * h != d:
            raise _unsupported("llama", "head_dim", head_dim, f"hidden_size / num_attention_heads = {d // h}")
        return dict(dim=d, n_layers=c["num_hidden_layers"], n_heads=h,
                    n_kv_heads=c.get("num_key_value_heads") or h, ffn_hidden=c["intermediate_size"],
                    vocab_size=c["vocab_size"], max_seq_len=c.get("max_position_embeddings", 2048), norm="rmsnorm",
                    softmax="softmax", pos_encoding="rope", rope_fraction=1.0, bias=attn_bias, qk_norm=False,
                    mlp="swiglu", tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                    norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=cls._rope_theta(c))

    @staticmethod
    def exportable(a) -> str | None:
        want = dict(norm="rmsnorm", pos_encoding="rope", rope_fraction=1.0, qk_norm=False, mlp="swiglu")
        for k, v in want.items():
            if getattr(a, k) != v:
                return f"model.{k} = {getattr(a, k)!r} (HF Llama needs {v!r})"
        return _softmax_only(a, "Llama")

    @staticmethod
    def hf_config(a) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
                "hidden_size": a.dim, "intermediate_size": a.ffn_hidden, "num_hidden_layers": a.n_layers,
                "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
                "head_dim": a.dim // a.n_heads, "hidden_act": "silu", "max_position_embeddings": a.max_seq_len,
                "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
                "attention_bias": a.bias, "mlp_bias": a.bias, "tie_word_embeddings": a.tie_embeddings,
                "attention_dropout": 0.0, "use_cache": True}

    @staticmethod
    def _names(i: int, bias: bool) -> list[tuple[str, str]]:
        h, o = f"model.layers.{i}.", f"layers.{i}."
        pairs = [("input_layernorm.weight", "attention_norm.weight"),
                 ("post_attention_layernorm.weight", "ffn_norm.weight")]
        for hf, ours in (("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                         ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                         ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                         ("mlp.down_proj", "feed_forward.w2")):
            pairs.append((hf + ".weight", ours + ".weight"))
            if bias:
                pairs.append((hf + ".bias", ours + ".bias"))
        return [(h + x, o + y) for x, y in pairs]

    @staticmethod
    def expected_hf_shapes(a) -> dict[str, tuple[int, ...]]:
        d, f, hd = a.dim, a.ffn_hidden, a.dim // a.n_heads
        kv = a.n_kv_heads * hd
        shapes = {"model.embed_tokens.weight": (a.vocab_size, d), "model.norm.weight": (d,)}
        for i in range(a.n_layers):
            h = f"model.layers.{i}."
            for name, shape in (("input_layernorm", (d,)), ("post_attention_layernorm", (d,)),
                                ("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (kv, d)),
                                ("self_attn.v_proj", (kv, d)), ("self_attn.o_proj", (d, d)),
                                ("mlp.gate_proj", (f, d)), ("mlp.up_proj", (f, d)), ("mlp.down_proj", (d, f))):
                shapes[h + name + ".weight"] = shape
                if a.bias and "layernorm" not in name:
                    shapes[h + name + ".bias"] = shape[:1]
        if not a.tie_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, d)
        return shapes

    @classmethod
    def _block_from_hf(cls, t: dict[str, torch.Tensor], i: int, a) -> dict[str, torch.Tensor]:
        return {ours: t[hf] for hf, ours in cls._names(i, a.bias)}

    @classmethod
    def _block_to_hf(cls, s: dict[str, torch.Tensor], i: int, a) -> dict[str, torch.Tensor]:
        return {hf: s[ours] for hf, ours in cls._names(i, a.bias)}


ADAPTERS = {"gpt2": GPT2Adapter, "llama": LlamaAdapter}
_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}


def adapter_for_hf(config: dict[str, Any]):
    """The adapter for an HF config; an unknown model type or architecture is an :class:`HFError`."""
    kind = config.get("model_type")
    if kind not in ADAPTERS:
        raise HFError(f"HF config.json: model_type = {kind!r} is not supported; supported: "
                      f"{', '.join(ADAPTERS)}")
    for arch in config.get("architectures") or []:
        if _ARCHITECTURES.get(arch) != kind:
            raise HFError(f"HF config.json: architecture {arch!r} is not supported; supported: "
                          f"{', '.join(_ARCHITECTURES)}")
    return ADAPTERS[kind]


def _value_path_step(args) -> str | None:
    """Why a model with V-scale or head-wise RMSNorm (``models/value_path.py``) has no HF form, or None."""
    for option in ("v_scale", "head_norm"):
        if getattr(args, option, "off") != "off":
            return f"model.{option} = {getattr(args, option)!r} (neither HF GPT-2 nor Llama has that step)"
    return None


def adapter_for_args(args) -> tuple[Any, str]:
    """(adapter, "") for a ``pre_ln`` model HF can hold, else (None, why not for the closest family)."""
    mlp = getattr(args, "mlp", None)
    adapter = LlamaAdapter if mlp == "swiglu" else GPT2Adapter
    why = _value_path_step(args) or adapter.exportable(args)
    return (None, why) if why else (adapter, "")


def hf_model_config(path: str | Path) -> Model:
    """The ``[model]`` config section (every ``pre_ln`` option explicit) that reproduces an HF folder's model."""
    config = read_hf_config(path)
    adapter = adapter_for_hf(config)
    options = adapter.options_from_hf(config)
    return section_class("model")(name="pre_ln", flavor="debug_llama" if adapter.family == "llama" else "debug", **options)
