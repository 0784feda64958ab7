"""The 4-bit schemes: int4 quantisers on hand examples, the KV-cache hook, the QuaRot rotation (exact in float64)
and GPTQ against a direct float64 implementation of the paper's update."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from outlier_titan.models.init import Initializer
from outlier_titan.models.attention_variants import variants
from outlier_titan.models.pre_ln import GPT2, LLAMA
from outlier_titan.models.pre_ln.model import PreLNArgs, PreLNTransformer
from outlier_titan.quant import quantizers as qz
from outlier_titan.quant.gptq import channel_scales, gptq_quantize, rtn_grid_quantize
from outlier_titan.quant.ptq import SCHEMES, kv_quantizer, quantized
from outlier_titan.linalg import hadamard
from outlier_titan.quant.rotation import CenteredRMSNorm, orthogonal, rotate


def close(a, b, atol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------ quantisers


def test_int4_symmetric_weight_per_output_channel_hand_example():
    w = torch.tensor([[0.7, -0.33, 0.1], [1.4, 0.3, -0.2]])
    # row 0: s = 0.7/7 = 0.1 -> codes 7, -3 (-3.3), 1; row 1: s = 0.2 -> 7, 2 (1.5 -> 2, half to even), -1
    assert close(qz.absmax_quantize(w, 4, reduce_dims=(1,)), [[0.7, -0.3, 0.1], [1.4, 0.4, -0.2]])


def test_int4_symmetric_activation_per_token_hand_example():
    x = torch.tensor([[[0.7, 0.2, -0.36], [1.4, -0.52, 0.05]]])  # [B=1, T=2, D=3]
    # token 0: s = 0.1 -> 7, 2, -4 (-3.6); token 1: s = 0.2 -> 7, -3 (-2.6), 0 (0.25)
    assert close(qz.absmax_quantize(x, 4, reduce_dims=(-1,)), [[[0.7, 0.2, -0.4], [1.4, -0.6, 0.0]]])


def test_int4_asymmetric_kv_groups_hand_example():
    x = torch.tensor([-1.0, 0.0, 0.5, 0.0, 0.33, 3.0])
    # group 1 [-1, 0, 0.5]: s = 1.5/15 = 0.1, z = 10 -> codes 0, 10, 15 (exact)
    # group 2 [0, 0.33, 3]: s = 3/15 = 0.2, z = 0 -> codes 0, 2 (1.65), 15
    assert close(qz.group_zeropoint_quantize(x, 4, group_size=3), [-1.0, 0.0, 0.5, 0.0, 0.4, 3.0])
    # one group over the whole last dim: lo = -1, hi = 3, s = 4/15, z = round(3.75) = 4
    s = 4 / 15
    expect = [(min(max(round(v / s) + 4, 0), 15) - 4) * s for v in x.tolist()]
    assert close(qz.group_zeropoint_quantize(x, 4), expect)
    with pytest.raises(ValueError, match="group size 4"):
        qz.group_zeropoint_quantize(x, 4, group_size=4)


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.tensor([[0.7, -0.33, 0.1], [1.4, 0.3, -0.2]]))

    def forward(self, x):
        return self.proj(x)


def test_w4a4_and_w4a16_and_w8a8_dynamic_on_one_linear_by_hand():
    m = OneLinear()
    x = torch.tensor([[[0.7, 0.2, -0.36], [1.4, -0.52, 0.05]]])
    w4 = torch.tensor([[0.7, -0.3, 0.1], [1.4, 0.4, -0.2]])  # the hand-quantised weight above
    x4 = torch.tensor([[[0.7, 0.2, -0.4], [1.4, -0.6, 0.0]]])  # the hand-quantised tokens above
    with torch.no_grad():
        with quantized(m, "w4a4kv4_rtn") as info:
            assert close(m(x), x4 @ w4.t())
        assert info["kv_cache"] == 0 and info["linear_layers"] == 1
        with quantized(m, "w4a16_rtn"):
            assert close(m(x), x @ w4.t())
        # int8: W rows s = 0.7/127, 1.4/127; tokens s = 0.7/127, 1.4/127
        w8 = qz.absmax_quantize(m.proj.weight, 8, (1,))
        x8 = qz.absmax_quantize(x, 8, (-1,))
        assert close(w8[0, 1], round(-0.33 / (0.7 / 127)) * 0.7 / 127)
        assert close(x8[0, 1, 2], round(0.05 / (1.4 / 127)) * 1.4 / 127)
        with quantized(m, "w8a8_dynamic"):
            assert close(m(x), x8 @ w8.t())
        assert torch.equal(m.proj.weight, OneLinear().proj.weight)  # restored


def test_kv_hook_quantises_k_and_v_per_head_and_token_after_rope():
    torch.manual_seed(0)
    a = PreLNArgs(**dict(LLAMA, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=16))
    m = PreLNTransformer(a)
    m.init_weights(Initializer(0, torch.device("cpu")))
    att = m.layers["0"].attention
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        with quantized(m, "w4a4kv4_rtn") as info:
            assert info["kv_cache"] == 1
            q2, k2, v2 = att.project_qkv(x)
            hook, att.kv_quant = att.kv_quant, None
            q, k, v = att.project_qkv(x)  # the same quantised linears without the KV quantiser
            att.kv_quant = hook
        assert att.kv_quant is None  # removed again
    assert torch.equal(q2, q)  # queries stay in full precision
    assert close(k2, qz.zeropoint_quantize(k, 4, reduce_dims=(-1,))) and close(v2, qz.zeropoint_quantize(v, 4, (-1,)))
    assert max(len(row.unique()) for row in k2.reshape(-1, 8)) <= 16
    # rotated: quantised in the per-head Hadamard basis, Q(k R) R^T
    r = hadamard(8)
    kr, vr = kv_quantizer(4, None, r)(k, v)
    assert close(kr, (qz.zeropoint_quantize((k.double() @ r).float(), 4, (-1,)).double() @ r.t()), atol=1e-5)
    assert not close(kr, k2, atol=1e-4)


# ------------------------------------------------------------------------------------------ rotation


def test_hadamard_orders():
    for n in (1, 2, 8, 12, 20, 24, 48, 192, 384):
        h = hadamard(n)
        assert close(h @ h.t(), torch.eye(n), atol=1e-12), n
        assert close(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64), atol=1e-12), n
    assert hadamard(3) is None and hadamard(36) is None
    q, kind = orthogonal(6, 0, randomise=True)
    assert close(q @ q.t(), torch.eye(6), atol=1e-12) and kind.startswith("random orthogonal")
    q, kind = orthogonal(16, 4, randomise=True)
    assert close(q.abs(), hadamard(16).abs()) and kind == "randomised Hadamard 16" and not close(q, hadamard(16))
    assert torch.equal(q, orthogonal(16, 4, randomise=True)[0]) and not torch.equal(q, orthogonal(16, 5, True)[0])


def _model(base: dict, std: float = 0.02, seed: int = 0, **kw) -> PreLNTransformer:
    a = PreLNArgs(**dict(base, dim=48, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, init_std=std, **kw))
    m = PreLNTransformer(a)
    m.init_weights(Initializer(seed, torch.device("cpu")))
    return m.eval()


def _perturbed_double(m: PreLNTransformer) -> tuple[PreLNTransformer, torch.Tensor]:
    """The model with every parameter moved by 0.3 N(0, 1) (seeded), in float64, and a fixed token batch."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m.double(), torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("base,kw", [
    (GPT2, {}),  # LayerNorm with biases, learned positions, tied head
    (LLAMA, dict(n_kv_heads=2)),  # RMSNorm, RoPE, SwiGLU, GQA, untied head
    (LLAMA, dict(norm="rmsnorm_single", qk_norm=True, softmax="softmax1", tie_embeddings=True)),
    (GPT2, dict(bias=False, mlp="relu")),  # LayerNorm without biases
], ids=["layernorm_gpt2", "rmsnorm_llama", "rmsnorm_single_qknorm", "layernorm_nobias"])
def test_rotated_model_equals_the_original_in_float64(base, kw):
    m, tokens = _perturbed_double(_model(base, **kw))  # non-trivial gains and biases, so folding them matters
    rot, info = rotate(m, seed=5)
    with torch.no_grad():
        ref, out = m(tokens), rot(tokens)
    assert float((out - ref).abs().max()) < 1e-10 * float(ref.abs().max())
    assert "randomised Hadamard 48" in info["residual_rotation"] and len(info["online"]) == 2
    assert rot.output is not None and all(isinstance(b.attention_norm, nn.Module) for b in rot.layers.values())
    # the rotation is not the identity: the embedding rows are rotated
    assert not close(rot.tok_embeddings.weight, m.tok_embeddings.weight, atol=1e-3)
    with torch.no_grad():
        assert torch.equal(m(tokens), ref)  # the original is untouched


@pytest.mark.parametrize("attention", sorted(v.name for v in variants()))
def test_rotation_is_exact_for_every_attention_variant_and_the_osp_projections(attention):
    """Every variant's extra parameters stay exact under the rotation (a gate's wg reads the normalised input like
    wq / wk / wv; a sink logit is per head), and so do both OSP projections."""
    m, tokens = _perturbed_double(_model(LLAMA, attention=attention, norm="rmsnorm_single", embed_proj=True))
    rot, _ = rotate(m, seed=5)
    with torch.no_grad():
        ref, out = m(tokens), rot(tokens)
    assert float((out - ref).abs().max()) < 1e-10 * float(ref.abs().max()), attention


def _op_model(seed: int = 0, std: float = 0.02, **kw):
    from outlier_titan.models.op.model import OPArgs, OPTransformer

    a = OPArgs(**dict(dict(dim=48, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, init_std=std), **kw))
    a.validate()
    m = OPTransformer(a)
    m.init_weights(Initializer(seed, torch.device("cpu")))
    return m.eval()


@pytest.mark.parametrize("kw", [
    dict(block="op", residual_scale_mode="fixed", final_norm=False),  # the paper's OP block: no norm at all
    dict(block="op", residual_scale_mode="vector", input_norm=True, final_norm=True, mlp_alpha="analytic",
         mlp="gelu", pos_encoding="rope", tie_embeddings=True),  # LayerScale; LayerNorms beside raw reads
    dict(block="op", residual_scale_mode="scalar", mlp_alpha="trainable", bias=True, embed_scale=50.0),
    dict(block="pre_ln", residual_scale_mode="none", qk_norm=False, final_norm=True, bias=True),  # all LayerNorm
    dict(block="pre_ln", residual_scale_mode="fixed", final_norm=False),  # LayerNorms, raw head read
    dict(block="pre_rms", residual_scale_mode="none", qk_norm=False, final_norm=True),  # final LayerNorm
    dict(block="pre_srms", residual_scale_mode="none", qk_norm=False, final_norm=True, embed_scale=50.0),
], ids=["op", "op_layerscale_input_norm", "op_scalar_bias", "pre_ln", "pre_ln_no_final_norm", "pre_rms",
        "pre_srms"])
def test_op_spec_rotation_is_exact_for_every_block_but_post_ln(kw):
    """The OP spec's residual stream is only added to and read (OP reads it raw): rotated exactly, with
    LayerScale folded into the writers and LayerNorms read as centred RMSNorms where the stream cannot be made
    zero-mean."""
    m, tokens = _perturbed_double(_op_model(**kw))
    rot, info = rotate(m, seed=3)
    with torch.no_grad():
        ref, out = m(tokens), rot(tokens)
    assert float((out - ref).abs().max()) < 1e-10 * float(ref.abs().max()), info
    assert info["residual_rotation"].startswith("residual stream: randomised Hadamard 48;"), info
    assert not close(rot.tok_embeddings.weight, m.tok_embeddings.weight, atol=1e-3)
    centred = any(isinstance(x, CenteredRMSNorm) for x in rot.modules())
    a = m.args
    all_layernorm = a.block == "pre_ln" and a.final_norm
    assert centred == (not all_layernorm and (a.block != "op" or a.input_norm or a.final_norm))
    assert ("mean-subtracted" in info["residual_rotation"]) == all_layernorm
    assert ("residual scales folded" in info["residual_rotation"]) == (kw["residual_scale_mode"] == "vector")


def test_specs_without_rotation_invariance_get_only_the_exact_online_hadamards():
    from outlier_titan.config.job_config import Model
    from outlier_titan.models.registry import model_args

    for name, opts in (("op", dict(block="post_ln")), ("angpt", {}), ("ngpt", {})):
        spec, args = model_args(Model(name=name, flavor="debug", **opts), vocab_size=64, seq_len=16)
        m = spec.build(args)
        m.init_weights(Initializer(0, torch.device("cpu")))
        m = m.double().eval()
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        rot, info = rotate(m, 0)
        with torch.no_grad():
            ref = m(tokens)
            assert float((rot(tokens) - ref).abs().max()) < 1e-10 * float(ref.abs().max()), name
        assert info["residual_rotation"].startswith("not applied"), name
        assert any(s.startswith("w2:") for s in info["online"]) and any(s.startswith("wo:") for s in info["online"])


def _self_labelled_ppl(model, tokens, labels) -> float:
    return math.exp(F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).item())


@pytest.mark.parametrize("base", [LLAMA, GPT2], ids=["rmsnorm", "layernorm"])
def test_rotation_cuts_the_w4a4_damage_of_an_outlier_channel(base):
    """A channel made 100x larger in every norm's output (its gain x100, the readers' weights / 100: the same
    function in full precision) ruins per-token int4 activations; after the rotation it does not matter. Labels
    are sampled from the full-precision model itself, so that quantisation error raises the perplexity."""
    m = _model(base, std=0.1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (8, 32), generator=g)
    with torch.no_grad():
        labels = torch.multinomial(F.softmax(m(tokens), -1).flatten(0, 1), 1, generator=g).view(8, 32)
        fp = _self_labelled_ppl(m, tokens, labels)
        for b in m.layers.values():
            att, ff = b.attention, b.feed_forward
            for norm, readers in ((b.attention_norm, (att.wq, att.wk, att.wv)), (b.ffn_norm, (ff.w1, ff.w3))):
                norm.weight[5] *= 100.0
                for lin in readers:
                    if lin is not None:
                        lin.weight[:, 5] /= 100.0
        assert _self_labelled_ppl(m, tokens, labels) == pytest.approx(fp, rel=1e-4)
        delta = {}
        for name in ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard"):
            with quantized(m, name) as info:
                delta[name] = _self_labelled_ppl(info["model"], tokens, labels) - fp
    assert delta["w4a4kv4_rtn"] > 3 * max(delta["w4a4kv4_rtn_hadamard"], 0.01 * fp), delta


def test_rotation_cuts_the_int4_activation_damage_of_an_outlier_channel_of_the_op_block():
    """The OP block has no norms, so an outlier is a channel of the residual stream itself: every write into
    channel 5 x20 and every read of it / 20 (the same function). Per-token int4 inputs of the raw reads lose the
    other channels; after the rotation they keep them (measured over model seeds 0-4 and rotation seeds 0-2:
    Δppl 7.1-9.8 unrotated, -0.5 to 1.9 rotated, PPL 52-64). Activations only: the rotation spreads the x20 writer
    rows over every row of the rotated writers, so int4 RTN weights would mix in a second effect."""
    from dataclasses import replace

    m = _op_model(std=0.1, block="op", residual_scale_mode="none", final_norm=False, tie_embeddings=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (8, 32), generator=g)
    with torch.no_grad():
        labels = torch.multinomial(F.softmax(m(tokens), -1).flatten(0, 1), 1, generator=g).view(8, 32)
        fp = _self_labelled_ppl(m, tokens, labels)
        for e in (m.tok_embeddings, m.pos_embeddings):
            if e is not None:
                e.weight[:, 5] *= 20.0
        for b in m.layers.values():
            att, ff = b.attention, b.feed_forward
            for lin in (att.wo, ff.w2):
                lin.weight[5] *= 20.0
            for lin in (att.wq, att.wk, att.wv, ff.w1, ff.w3):
                if lin is not None:
                    lin.weight[:, 5] /= 20.0
        m.output.weight[:, 5] /= 20.0
        assert _self_labelled_ppl(m, tokens, labels) == pytest.approx(fp, rel=1e-4)
        a4 = replace(SCHEMES["w4a4kv4_rtn"], name="a4", weight=None, kv_bits=None)
        delta = {}
        for scheme in (a4, replace(a4, name="a4_hadamard", rotate=True)):
            with quantized(m, scheme) as info:
                delta[scheme.name] = _self_labelled_ppl(info["model"], tokens, labels) - fp
    assert delta["a4"] > 3 * max(delta["a4_hadamard"], 0.01 * fp), delta


# ------------------------------------------------------------------------------------------ GPTQ


def _gptq_direct(w: torch.Tensor, h: torch.Tensor, bits: int, damp: float) -> torch.Tensor:
    """The paper's update written out (float64): quantise column q, spread its error over the remaining columns
    with delta = -(w_q - quant(w_q)) / [H^-1]_qq * (H^-1)_{:,q}, then remove q from H^-1 by Gaussian elimination."""
    w, h = w.double().clone(), h.double().clone()
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    scale = channel_scales(w, bits)
    q = torch.zeros_like(w)
    for j in range(w.shape[1]):
        q[:, j] = rtn_grid_quantize(w[:, j:j + 1], scale, bits)[:, 0]
        err = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j + 1:] -= err[:, None] * hinv[j, j + 1:][None, :]
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return q


def test_gptq_equals_the_direct_formula_and_beats_rtn():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 10, generator=g, dtype=torch.float64)
    x = torch.randn(64, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g, dtype=torch.float64)
    h = 2 * x.t() @ x / 64
    ref = _gptq_direct(w, h, 4, 0.01)
    for block in (3, 128):  # lazy blocks give the same numbers
        assert torch.allclose(gptq_quantize(w, h, 4, 0.01, block=block), ref, atol=1e-12, rtol=0)
    q = gptq_quantize(w, h, 4)
    codes = q / channel_scales(w, 4)  # on the RTN grid of the original weight
    assert torch.allclose(codes, codes.round(), atol=1e-9) and codes.abs().max() <= 7
    rtn = rtn_grid_quantize(w, channel_scales(w, 4), 4)
    err = lambda wq: float(((wq - w) @ x.t()).square().sum())  # noqa: E731
    assert err(q) < err(rtn)
    # a dead input (never active) gets zero weight and leaves the rest well defined
    x[:, 3] = 0
    q = gptq_quantize(w, 2 * x.t() @ x / 64, 4)
    assert torch.all(q[:, 3] == 0) and torch.isfinite(q).all()


def test_gptq_schemes_on_a_model_reduce_the_output_error_of_rtn():
    m = _model(LLAMA, std=0.1)
    calib = [torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with torch.no_grad():
        ref = torch.cat([m(t) for t in calib])
        err = {}
        for name in ("w4a16_rtn", "w4a16_gptq", "w4a16_gptq_hadamard"):
            with quantized(m, name, calib) as info:
                err[name] = float((torch.cat([info["model"](t) for t in calib]) - ref).square().mean())
        assert torch.equal(torch.cat([m(t) for t in calib]), ref)  # restored
    assert err["w4a16_gptq"] < err["w4a16_rtn"] and err["w4a16_gptq_hadamard"] < err["w4a16_rtn"], err
    with pytest.raises(ValueError, match="needs calibration"):
        with quantized(m, "w4a4kv4_gptq"):
            pass


def test_new_schemes_keep_the_head_in_full_precision():
    for name in ("w8a8_dynamic", "w4a16_rtn", "w4a4kv4_rtn", "w4a16_gptq", "w4a4kv4_gptq"):
        for n in (name, f"{name}_hadamard"):
            assert not SCHEMES[n].head, n
    assert SCHEMES["w4a4kv4_rtn_hadamard"].seeded and SCHEMES["w4a16_gptq"].seeded
    assert not SCHEMES["w4a4kv4_rtn"].seeded


# ------------------------------------------------------------------------------------------ evaluate.py


def test_evaluate_script_runs_the_new_schemes_on_an_hf_gpt2_folder(tmp_path, capsys):
    """tests/test_hf.py runs every scheme on a tiny HF Llama folder; here the GPT-2 family (LayerNorm, biases,
    learned positions, tied head) with the 4-bit schemes and their rotations."""
    import json

    from tests.test_evaluate import load_script
    from tests.test_hf import _corpus, tiny_gpt2

    folder = tiny_gpt2(tmp_path / "gpt2")
    corpus = _corpus(tmp_path / "corpus", n_docs=3, words=1500)
    names = ["w8a8_dynamic", "w4a4kv4_rtn", "w4a4kv4_rtn_hadamard", "w4a4kv4_gptq", "w4a4kv4_gptq_hadamard"]
    capsys.readouterr()
    rc = load_script("evaluate").main(["--hf", str(folder), "--tokenizer", "embedded", "--data", str(corpus),
                                       "--tokens", "128", "--batch-size", "2", "--seq-len", "32",
                                       "--calib-batches", "1", "--calib-seeds", "2", "--device", "cpu",
                                       "--schemes", ",".join(names)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    report = json.loads((folder / "eval" / "model.json").read_text())
    rows = {e["scheme"]: e for e in report["schemes"]}
    assert list(rows) == names
    for name, e in rows.items():
        assert math.isfinite(e["ppl"]) and len(e["ppl_runs"]) == (2 if SCHEMES[name].seeded else 1), name
    assert "head untied" in rows["w4a4kv4_rtn_hadamard"]["rotation"]["residual_rotation"]
    assert "LayerNorm" in rows["w4a4kv4_rtn_hadamard"]["rotation"]["residual_rotation"]
    assert "Rotated schemes (`_hadamard`, QuaRot)" in out.out and "| w4a4kv4_gptq_hadamard |" in out.out
