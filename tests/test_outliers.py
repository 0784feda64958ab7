"""Known-answer tests of the outlier metrics (outlier_titan.observe.outliers) and their reducible sums."""

from __future__ import annotations

import math

import pytest
import torch

from outlier_titan.models.layers import explicit_attention_probs
from outlier_titan.observe import metrics
from outlier_titan.observe import outliers as om
from outlier_titan.observe.probe import _map_sums

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- Kaul et al. 2024 Eq. 2


def test_gaussian_token_kurtosis_is_three():
    x = torch.randn(256, 1024, generator=gen(0), dtype=F64)
    k = om.token_kurtosis(x)
    assert k.shape == (256,)
    assert abs(float(k.mean()) - 3.0) < 0.05
    # each token on its own: the sampling sd of the kurtosis at D = 1024 is sqrt(24/1024) ~ 0.15
    assert float(((k - 3.0).abs() < 0.6).double().mean()) > 0.99


def test_token_kurtosis_planted_outlier_exact_closed_form():
    # D - 1 channels of exactly +-1 (balanced) and one channel alpha: the centred moments in closed form.
    d, alpha = 1025, 40.0
    x = torch.ones(d, dtype=F64)
    x[1::2] = -1.0
    x[0] = alpha
    mu = alpha / d
    m2 = ((alpha - mu) ** 2 + (d - 1) * (1 + mu ** 2)) / d
    m4 = ((alpha - mu) ** 4 + (d - 1) * (1 + 6 * mu ** 2 + mu ** 4)) / d
    assert float(om.token_kurtosis(x)) == pytest.approx(m4 / m2 ** 2, rel=1e-12)


@pytest.mark.parametrize("d,alpha", [(4096, 1000.0), (1024, 100.0)])
def test_token_kurtosis_planted_outlier_gaussian_closed_form(d, alpha):
    # Kaul et al. 2024 §2.7: x = alpha e_i + z, z ~ N(0, I)  ->  Kurt ~ D (alpha^4 + 3 D) / (alpha^2 + D)^2
    z = torch.randn(16, d, generator=gen(1), dtype=F64)
    z[:, 7] += alpha
    k = float(om.token_kurtosis(z).mean())
    closed = d * (alpha ** 4 + 3 * d) / (alpha ** 2 + d) ** 2
    assert k == pytest.approx(closed, rel=0.02)


def test_token_kurtosis_scale_and_shift_invariant():
    x = torch.randn(8, 300, generator=gen(2), dtype=F64)
    assert torch.allclose(om.token_kurtosis(5.0 * x + 3.0), om.token_kurtosis(x), rtol=1e-10)


# ---------------------------------------------------------------------------------------------- He et al. 2024 Eq. 1


def test_gaussian_neuron_rms_kurtosis_is_one():
    x = torch.randn(4096, 1024, generator=gen(3), dtype=F64)
    # E[s_j^2] = 1 for every neuron, spread 2/n: Kurt = 1 + O(2/n)
    assert float(om.neuron_rms_kurtosis(x)) == pytest.approx(1.0, abs=0.01)


def test_neuron_rms_kurtosis_constant_magnitude_is_exactly_one():
    signs = torch.randint(0, 2, (50, 64), generator=gen(4)).to(F64) * 2 - 1
    assert float(om.neuron_rms_kurtosis(3.0 * signs)) == pytest.approx(1.0, abs=1e-12)


def test_neuron_rms_kurtosis_planted_outlier_closed_form():
    # X = Z + alpha e_i on every token: s_i^2 ~ alpha^2 + 1, others ~ 1:
    # Kurt = d ((alpha^2 + 1)^2 + d - 1) / (alpha^2 + d)^2
    n, d, alpha = 4096, 256, 30.0
    x = torch.randn(n, d, generator=gen(5), dtype=F64)
    x[:, 3] += alpha
    closed = d * ((alpha ** 2 + 1) ** 2 + d - 1) / (alpha ** 2 + d) ** 2
    assert float(om.neuron_rms_kurtosis(x)) == pytest.approx(closed, rel=0.01)


def test_neuron_rms_kurtosis_one_dominant_neuron_tends_to_d():
    d = 64
    x = torch.randn(512, d, generator=gen(6), dtype=F64)
    x[:, 0] *= 1e5
    assert float(om.neuron_rms_kurtosis(x)) == pytest.approx(d, rel=1e-6)


def test_neuron_rms_kurtosis_uniform_correlation_prop_g1():
    # He et al. 2024 Prop. G.1: columns N(0, (1 - rho) I + rho 11^T) over tokens -> Kurt ~ 1 + 2 rho^2
    n, d, rho = 1024, 4096, 0.3
    g = gen(7)
    z = torch.randn(1, d, generator=g, dtype=F64)
    u = torch.randn(n, d, generator=g, dtype=F64)
    x = math.sqrt(rho) * z + math.sqrt(1 - rho) * u
    assert float(om.neuron_rms_kurtosis(x)) == pytest.approx(1 + 2 * rho ** 2, abs=0.05)


def test_centred_variant_is_unbiased_var_minus_one_form():
    x = torch.randn(2048, 512, generator=gen(8), dtype=F64)
    x[:, 5] += 4.0
    c = float(om.neuron_rms_kurtosis_centred(x))
    xc = x - x.mean(-1, keepdim=True)
    d = x.shape[1]
    assert c == pytest.approx(d / (d - 1) * (float(om.neuron_rms_kurtosis(xc)) - 1.0), rel=1e-10)
    g = torch.randn(4096, 512, generator=gen(9), dtype=F64)
    assert abs(float(om.neuron_rms_kurtosis_centred(g))) < 0.01  # Gaussian: Kurt - 1 ~ 0


# ---------------------------------------------------------------------------------------------- other metrics


def test_max_median_ratio_hand_example():
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0, 10.0], [2.0, -2.0, 2.0, 2.0, -2.0]])
    assert om.max_median_ratio(x).tolist() == pytest.approx([10.0 / 3.0, 1.0])


def test_norm_ratio():
    x = torch.zeros(2, 100, dtype=F64)
    x[0, 3] = 5.0
    x[1] = 1.0
    assert om.norm_ratio(x).tolist() == pytest.approx([1.0, 0.01])


def test_mean_pairwise_cosine_known_and_brute_force():
    same = torch.tensor([[1.0, 2.0, 3.0]] * 5, dtype=F64) * torch.arange(1, 6, dtype=F64)[:, None]
    assert float(om.mean_pairwise_cosine(same)) == pytest.approx(1.0)
    assert float(om.mean_pairwise_cosine(torch.eye(4, dtype=F64))) == pytest.approx(0.0, abs=1e-15)
    # three vectors: cos(e1, e1+e2) = 1/sqrt2, cos(e1, e2) = 0, cos(e2, e1+e2) = 1/sqrt2 -> mean sqrt2/3
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=F64)
    assert float(om.mean_pairwise_cosine(v)) == pytest.approx(math.sqrt(2) / 3)
    x = torch.randn(3, 7, 16, generator=gen(10), dtype=F64) + 0.5
    u = x.reshape(-1, 16) / x.reshape(-1, 16).norm(dim=-1, keepdim=True)
    gram = u @ u.T
    n = gram.shape[0]
    brute = (gram.sum() - gram.diagonal().sum()) / (n * (n - 1))
    assert float(om.mean_pairwise_cosine(x)) == pytest.approx(float(brute), rel=1e-12)


def test_signal_prop_corr_brute_force():
    x = torch.randn(40, 24, generator=gen(11), dtype=F64) + 0.3
    n, d = x.shape
    xt = x / (x.square().sum() / (n * d)).sqrt()
    g = xt @ xt.T / d
    brute = (g.sum() - g.diagonal().sum()) / (n * (n - 1))
    assert float(om.signal_prop_corr(x)) == pytest.approx(float(brute), rel=1e-12)


# ---------------------------------------------------------------------------------------------- attention


def uniform_causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=F64).tril() / torch.arange(1, t + 1, dtype=F64)[:, None]


def test_all_mass_on_first_key():
    t = 16
    p = torch.zeros(2, 3, t, t)
    p[..., 0] = 1.0
    assert float(om.first_token_argmax_share(p)) == 1.0
    assert float(om.first_token_argmax_share(p, exclude_first_query=True)) == 1.0
    assert float(om.first_token_attention_mass(p)) == 1.0
    s = metrics.measure("attention", p)
    assert s["first_token_argmax_share"] == 1.0 and s["first_token_attention_mass"] == 1.0
    assert "attention_sink_mass" not in s  # plain softmax has no sink: not reported


def test_uniform_causal_attention_expected_values():
    t = 32
    p = uniform_causal(t).expand(2, 4, t, t)
    harmonic = sum(1.0 / (i + 1) for i in range(t))
    # every row ties over its visible keys; ties resolve to the lowest index, i.e. key 0
    assert float(om.first_token_argmax_share(p)) == 1.0
    assert float(om.first_token_attention_mass(p)) == pytest.approx(harmonic / t, rel=1e-12)
    # the same through the model's own explicit-probability path (zero queries/keys = uniform causal)
    q = torch.zeros(2, 4, t, 8)
    probs = explicit_attention_probs(q, q, "softmax", 8 ** -0.5)
    m = metrics.measure("attention", probs)
    assert m["first_token_argmax_share"] == 1.0
    assert m["first_token_attention_mass"] == pytest.approx(harmonic / t, rel=1e-6)
    assert m["first_token_attention_mass_norm"] == pytest.approx(harmonic / t, rel=1e-6)
    assert m["attention_entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(t)) / t, rel=1e-5)


def test_softmax1_uniform_logits_mass_and_sink():
    # zero logits under softmax-1: query i sees i + 1 keys of weight 1 / (i + 2); the sink keeps 1 / (i + 2)
    t = 20
    q = torch.zeros(1, 2, t, 8)
    m = metrics.measure("attention", explicit_attention_probs(q, q, "softmax1", 1.0), sink=True)
    assert m["first_token_attention_mass"] == pytest.approx(sum(1 / (i + 2) for i in range(t)) / t, rel=1e-6)
    assert m["first_token_attention_mass_norm"] == pytest.approx(sum(1 / (i + 1) for i in range(t)) / t, rel=1e-6)
    assert m["attention_sink_mass"] == pytest.approx(sum(1 / (i + 2) for i in range(t)) / t, rel=1e-6)


def test_diagonal_attention_first_key_only_for_query_zero():
    t = 10
    p = torch.eye(t).expand(3, 2, t, t)
    assert float(om.first_token_argmax_share(p)) == pytest.approx(1.0 / t)
    assert float(om.first_token_argmax_share(p, exclude_first_query=True)) == 0.0
    assert float(om.first_token_attention_mass(p)) == pytest.approx(1.0 / t)


def test_attention_map_sum_is_corner_mean():
    t, k = 12, 5
    p = torch.softmax(torch.randn(2, 3, t, t, generator=gen(12)).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")), -1)
    s = _map_sums(metrics.AttentionInput(p), k)
    assert s["map"].shape == (k, k)
    assert torch.allclose(s["map"] / s["n_maps"], p[:, :, :k, :k].mean((0, 1)).double(), atol=1e-7)


# ---------------------------------------------------------------------------------------------- reducible sums


def planted_stream(seed: int, b=4, t=9, d=48) -> torch.Tensor:
    x = torch.randn(b, t, d, generator=gen(seed), dtype=F64)
    x[:, 0, 2] += 25.0  # a first-token outlier
    x[:, :, 11] *= 6.0  # an outlier feature everywhere
    return x


def test_finalize_residual_matches_direct_definitions():
    x = planted_stream(13)
    m = metrics.measure("residual", x)
    k = om.token_kurtosis(x)
    assert m["kurtosis_first"] == pytest.approx(float(k[:, 0].mean()), rel=1e-12)
    assert m["kurtosis_rest"] == pytest.approx(float(k[:, 1:].mean()), rel=1e-12)
    assert m["kurtosis_all"] == pytest.approx(float(k.mean()), rel=1e-12)
    assert m["max_abs_first"] == pytest.approx(float(x[:, 0].abs().amax(-1).mean()), rel=1e-12)
    assert m["max_abs_rest"] == pytest.approx(float(x[:, 1:].abs().amax((1, 2)).mean()), rel=1e-12)
    assert m["kurtosis_neuron_rms"] == pytest.approx(float(om.neuron_rms_kurtosis(x)), rel=1e-12)
    assert m["kurtosis_neuron_rms_centred"] == pytest.approx(float(om.neuron_rms_kurtosis_centred(x)), rel=1e-10)
    assert m["max_median_ratio"] == pytest.approx(float(om.max_median_ratio(x).mean()), rel=1e-6)
    assert m["signal_prop_cos"] == pytest.approx(float(om.mean_pairwise_cosine(x)), rel=1e-10)
    assert m["signal_prop_corr"] == pytest.approx(float(om.signal_prop_corr(x)), rel=1e-10)
    assert m["residual_rms"] == pytest.approx(float(x.square().mean().sqrt()), rel=1e-12)
    assert m["residual_norm"] == pytest.approx(float(x.norm(dim=-1).mean()), rel=1e-12)
    assert m["norm_ratio"] == pytest.approx(float(om.norm_ratio(x).mean()), rel=1e-12)


def test_sums_of_a_split_batch_equal_the_whole():
    x = planted_stream(14, b=6)
    whole = metrics.measure("residual", x)
    parts = metrics.add_sums(metrics.layer_sums("residual", x[:2]), metrics.layer_sums("residual", x[2:]))
    split = metrics.finalize_layer(parts)
    assert whole.keys() == split.keys()
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-12), key


def test_layer_mean():
    assert metrics.layer_mean([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0}
    assert metrics.layer_mean([]) == {}
