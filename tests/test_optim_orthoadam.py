"""OrthoAdam on the tile engine: AdamW equivalence, real mixing, seeding, a dense Kronecker reference."""

import pytest
import torch

from outlier_titan.errors import CheckpointError
from outlier_titan.optim.bases import (REPRESENTATIONS, check_basis, haar_basis, hadamard_basis,
                                       is_signed_permutation, tile_seed)
from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.tiles.options import EngineOptions

NAMES = ["layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight", "layers.0.attention_norm.weight",
         "tok_embeddings.weight"]
SHAPES = [(12, 8), (8, 20), (8,), (16, 8)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64)) for s in SHAPES]


def _grads(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(n)]


def _groups(params):
    # decay / no-decay, as build_param_groups makes them
    return [{"params": [params[0], params[1]], "names": NAMES[:2], "weight_decay": 0.1},
            {"params": [params[2], params[3]], "names": NAMES[2:], "weight_decay": 0.0}]


def _run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def test_identity_bases_equal_torch_adamw():
    ps, qs = _params(), _params()
    opt = OrthoAdam(_groups(ps), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, basis="identity",
                    options=EngineOptions(tile_size=4, one_d="rotate", vocab_axis="tile"))
    ref = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in _groups(qs)], lr=1e-2,
                            betas=(0.9, 0.95), eps=1e-8)
    grads = _grads(25)
    a, b = _run(opt, ps, grads), _run(ref, qs, grads)
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= 1e-14
    for p, q in zip(ps, qs):
        for k in ("exp_avg", "exp_avg_sq"):
            assert (opt.state[p][k] - ref.state[q][k]).abs().max().item() <= 1e-14


@pytest.mark.parametrize("basis", ["haar", "hadamard"])
def test_mixing_bases_differ_from_adamw(basis):
    ps, qs = _params(), _params()
    opt = OrthoAdam(_groups(ps), lr=1e-2, basis=basis, options=EngineOptions(tile_size=4))
    ref = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in _groups(qs)], lr=1e-2,
                            betas=(0.9, 0.999))
    grads = _grads(10)
    a, b = _run(opt, ps, grads), _run(ref, qs, grads)
    # The rotated matrices move differently from AdamW (by a sizeable fraction of the total change)...
    for x, y, p0 in zip(a[:2], b[:2], _params()[:2]):
        assert (x - y).abs().max() > 0.1 * (y - p0).abs().max()
    # ...and so does the 1-D gain, which OrthoAdam rotates by default (one_d = "auto": Algorithm 1 rotates every
    # parameter); with one_d = "adamw" it moves exactly like AdamW.
    assert (a[2] - b[2]).abs().max() > 0.1 * (b[2] - _params()[2]).abs().max()
    ps = _params()
    plain_1d = OrthoAdam(_groups(ps), lr=1e-2, basis=basis, options=EngineOptions(tile_size=4, one_d="adamw"))
    assert (_run(plain_1d, ps, grads)[2] - b[2]).abs().max() <= 1e-14


def test_signed_permutation_basis_is_rejected():
    def signed_permutation(size, seed):
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(size, generator=g)
        signs = torch.randint(0, 2, (size,), generator=g).to(torch.float64) * 2 - 1
        return torch.eye(size, dtype=torch.float64)[perm] * signs

    with pytest.raises(ValueError, match="signed permutation"):
        OrthoAdam(_groups(_params()), basis=signed_permutation, options=EngineOptions(tile_size=4))

    def not_orthogonal(size, seed):
        return torch.ones(size, size, dtype=torch.float64)

    with pytest.raises(ValueError, match="not orthogonal"):
        OrthoAdam(_groups(_params()), basis=not_orthogonal, options=EngineOptions(tile_size=4))


@pytest.mark.parametrize("name", ["haar", "hadamard"])
def test_builtin_bases_are_orthogonal_and_mix(name):
    for size in (2, 8, 64):
        b = REPRESENTATIONS[name].dense(size, tile_seed(0, "x.weight", 0, 3))
        check_basis(b, size, name)
        assert not is_signed_permutation(b)
        if size >= 8:
            # every column spreads over the tile: no coordinate keeps most of its mass
            assert b.abs().max() < 0.9
    h = hadamard_basis(16, 7)
    assert torch.allclose(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))


def test_seeds_depend_on_fqn_axis_tile_not_order():
    assert tile_seed(0, "a.weight", 0, 1) == tile_seed(0, "a.weight", 0, 1)
    seeds = {tile_seed(0, "a.weight", 0, 1), tile_seed(1, "a.weight", 0, 1), tile_seed(0, "b.weight", 0, 1),
             tile_seed(0, "a.weight", 1, 1), tile_seed(0, "a.weight", 0, 2)}
    assert len(seeds) == 5
    # A pinned value: the hash scheme is part of the checkpoint contract.
    assert tile_seed(0, "layers.0.attention.wq.weight", 1, 0) == 8825965834181084536
    # Param order and grouping do not change the bases / updates.
    ps, qs = _params(), _params()
    one = OrthoAdam(_groups(ps), lr=1e-2, basis="haar", options=EngineOptions(tile_size=4))
    rev = [{"params": list(reversed(qs)), "names": list(reversed(NAMES)), "weight_decay": 0.0}]
    two = OrthoAdam(rev, lr=1e-2, basis="haar", options=EngineOptions(tile_size=4))
    for pg in one.param_groups:
        pg["weight_decay"] = 0.0
    grads = _grads(3)
    a = _run(one, ps, grads)
    b = _run(two, qs, grads)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _block_diag_basis(fn, seed, fqn, axis, size, tile):
    mats = []
    for k, start in enumerate(range(0, size, tile)):
        edge = min(tile, size - start)
        mats.append(fn(edge, tile_seed(seed, fqn, axis, k)))
    return torch.block_diag(*mats)


def test_haar_matches_dense_kronecker_reference_with_ragged_tiles():
    """OrthoAdam = Adam on vec(G) in the dense basis Q = BD0 ⊗ BD1 (block-diagonal per-axis tile bases)."""
    fqn, shape, tile, seed = "layers.0.attention.wq.weight", (11, 6), 4, 5
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = OrthoAdam([{"params": [p], "names": [fqn], "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps,
                    seed=seed, basis="haar", options=EngineOptions(tile_size=tile))
    q = torch.kron(_block_diag_basis(haar_basis, seed, fqn, 0, shape[0], tile),
                   _block_diag_basis(haar_basis, seed, fqn, 1, shape[1], tile))
    assert torch.allclose(q.T @ q, torch.eye(q.shape[0], dtype=torch.float64), atol=1e-12)
    w = w0.flatten().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    g_gen = torch.Generator().manual_seed(3)
    for t in range(1, 16):
        g = torch.randn(*shape, generator=g_gen, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        gh = q.T @ g.flatten()
        m = b1 * m + (1 - b1) * gh
        v = b2 * v + (1 - b2) * gh * gh
        s = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        w = w * (1 - lr * wd) - lr * (q @ s)
    torch.testing.assert_close(p.detach().flatten(), w, rtol=0, atol=1e-12)


def test_vocab_axis_identity_leaves_vocabulary_rows_unmixed():
    assert EngineOptions().vocab_axis == "tile"  # the default rotates it like the other axes
    def rows_touched(vocab_axis):
        p = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
        w0 = p.detach().clone()
        opt = OrthoAdam([{"params": [p], "names": ["tok_embeddings.weight"], "weight_decay": 0.0}], lr=1e-2,
                        basis="haar", options=EngineOptions(tile_size=8, shard_tile_size=8,
                                                                     vocab_axis=vocab_axis))
        g = torch.zeros_like(p)
        g[3] = torch.randn(8, dtype=torch.float64)
        p.grad = g
        opt.step()
        return (p.detach() != w0).any(1).nonzero().flatten().tolist(), opt

    touched, opt = rows_touched("identity")
    assert touched == [3]
    assert not opt.plans[opt.param_groups[0]["params"][0]].axes[0].rotate
    touched, _ = rows_touched("tile")
    assert len(touched) == 8  # the tile of row 3 (rows 0-7) mixes


def test_max_precond_dim_leaves_long_axes_unrotated():
    p = torch.nn.Parameter(torch.randn(40, 8, dtype=torch.float64))
    opt = OrthoAdam([{"params": [p], "names": ["layers.0.feed_forward.w1.weight"], "weight_decay": 0.0}],
                    basis="haar", options=EngineOptions(tile_size=8, max_precond_dim=32))
    a0, a1 = opt.plans[p].axes
    assert (a0.rotate, a1.rotate) == (False, True)


def test_hadamard_needs_power_of_two_tiles():
    p = torch.nn.Parameter(torch.randn(12, 8, dtype=torch.float64))
    with pytest.raises(Exception, match="power-of-two"):
        OrthoAdam([{"params": [p], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}],
                  basis="hadamard", options=EngineOptions(tile_size=12))
    opt = OrthoAdam([{"params": [p], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}],
                    basis="hadamard", options=EngineOptions(tile_size=12, tile_alignment="adapt"))
    assert [ax.tile for ax in opt.plans[p].axes] == [8, 8]  # 12 = 8 + ragged 4


def test_tile_size_overrides():
    p = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
    opts = EngineOptions(tile_size=8, shard_tile_size=8,
                         tile_size_overrides=("layers.*.wq.weight:1=16", "nothing.*=2"))
    opt = OrthoAdam([{"params": [p], "names": ["layers.3.attention.wq.weight"], "weight_decay": 0.0}],
                    basis="haar", options=opts)
    assert [ax.tile for ax in opt.plans[p].axes] == [8, 16]
    with pytest.raises(Exception, match="PATTERN"):
        EngineOptions(tile_size_overrides=("bad",))


def test_nonfinite_gradient_skips_and_counts():
    ps = _params()
    opt = OrthoAdam(_groups(ps), lr=1e-2, basis="haar", options=EngineOptions(tile_size=4))
    _run(opt, ps, _grads(2))
    before = [p.detach().clone() for p in ps]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in ps}
    gs = _grads(1, seed=9)[0]
    gs[1][0, 0] = float("inf")
    _run(opt, ps, [gs])
    assert opt.skipped_steps == 1
    for p, b in zip(ps, before):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[id(p)][k])
    _run(opt, ps, _grads(1, seed=10))
    assert opt.skipped_steps == 1 and float(opt.state[ps[0]]["step"]) == 3


def test_basis_spec_is_saved_and_verified():
    ps = _params()
    opt = OrthoAdam(_groups(ps), lr=1e-2, seed=1, basis="haar", options=EngineOptions(tile_size=4))
    _run(opt, ps, _grads(2))
    sd = opt.state_dict()
    assert "checksum=" in sd["param_groups"][0]["basis_spec"]
    assert "exp_avg" in sd["state"][0] and not any("bas" in k for k in sd["state"][0])
    same = OrthoAdam(_groups(_params()), lr=1e-2, seed=1, basis="haar", options=EngineOptions(tile_size=4))
    same.load_state_dict(sd)
    for wrong in (dict(seed=2, basis="haar"), dict(seed=1, basis="hadamard")):
        other = OrthoAdam(_groups(_params()), lr=1e-2, options=EngineOptions(tile_size=4), **wrong)
        with pytest.raises(CheckpointError, match="basis_spec"):
            other.load_state_dict(sd)


FAST_NAMES = ["layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight", "layers.0.attention_norm.weight",
              "tok_embeddings.weight", "layers.0.feed_forward.w1.weight"]
FAST_SHAPES = [(48, 32), (40, 64), (24,), (20, 32), (64, 256)]


@pytest.mark.parametrize("basis", ["hadamard", "haar_kron"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_factored_bases_equal_dense_bases_over_50_steps(basis, dtype, tol):
    """Permutation + signs + Kronecker factors applied in the parameter's layout (ragged pow2 tiles, two
    segments, an unrotated vocabulary axis, a rotated 1-D vector, a 256 = 16 x 16 tile) equal the dense
    tile products."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, generator=g, dtype=dtype) for s in FAST_SHAPES]
    grads = [[torch.randn(*s, generator=g, dtype=dtype) * 10.0 ** (i % 3 - 1) for i, s in enumerate(FAST_SHAPES)]
             for _ in range(50)]
    opts = EngineOptions(tile_size=32, shard_tile_size=16, one_d="rotate",
                         tile_size_overrides=("*.w1.weight:1=256",))
    out = []
    for dense in (False, True):
        ps = [torch.nn.Parameter(x.clone()) for x in init]
        opt = OrthoAdam([{"params": ps, "names": FAST_NAMES, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95),
                        basis=basis, options=opts, dense=dense, factored_min_tile=2)
        assert opt.structured is not dense and len(opt._kron) == (0 if dense else len(ps))
        out.append(_run(opt, ps, grads))
    for name, fast, ref, x0 in zip(FAST_NAMES, *out, init):
        assert not torch.equal(ref, x0)
        rel = ((fast - ref).norm() / (ref - x0).norm()).item()
        assert rel <= tol, (name, rel)


def test_resident_basis_bytes_count_dense_and_factored_forms():
    """One 256 x 256 matrix, one 256 tile per axis: dense bases are two 256 x 256 float32 matrices; the factored
    Hadamard holds per axis two int64 gathers, two float32 sign vectors and the shared 16 x 16 factors."""
    opts = EngineOptions(tile_size=256, shard_tile_size=256)
    sizes = {}
    for dense in (True, False):
        p = torch.nn.Parameter(torch.randn(256, 256))
        opt = OrthoAdam([{"params": [p], "names": ["layers.0.attention.wq.weight"]}], options=opts, dense=dense)
        sizes[dense] = opt.resident_basis_bytes()
    assert sizes[True] == 2 * 256 * 256 * 4
    assert sizes[False] == 2 * (2 * 256 * 8 + 2 * 256 * 4 + 2 * 16 * 16 * 4)


@pytest.mark.parametrize("basis", sorted(REPRESENTATIONS))
def test_a_non_power_of_two_tile_fails_the_meta_model_pre_check_when_the_basis_needs_it(basis):
    """A tile of 12 fails before the model is materialised exactly for the bases that declare ``needs_pow2``
    (hadamard and haar_kron), with one line naming the basis; OrthoAdam's own check at construction reads the
    same attribute and says the same."""
    from outlier_titan.config.job_config import Model as ModelConfig
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.models.roles import roles_of
    from outlier_titan.optim.builder import build_param_groups
    from outlier_titan.optim.tile_optimizers import check_tile_plans
    from outlier_titan.optim.tiles.plan import TileAlignmentError

    assert REPRESENTATIONS[basis].needs_pow2 == (basis in ("hadamard", "haar_kron"))
    _, _, model = build_meta_model(ModelConfig(name="pre_ln", flavor="debug"), 256, 32)
    cfg = OptimizerConfig(name="orthoadam", basis=basis, tile_size=12)
    groups = build_param_groups(model, cfg)
    own = [torch.nn.Parameter(torch.randn(24, 24))]
    expected = f"the {basis} basis needs power-of-two tiles (tile 12, ragged last tile"
    if not REPRESENTATIONS[basis].needs_pow2:
        check_tile_plans(groups, cfg, roles_of(model))
        OrthoAdam([{"params": own, "names": ["w"]}], basis=basis, options=EngineOptions(tile_size=12))
        return
    with pytest.raises(TileAlignmentError) as pre:
        check_tile_plans(groups, cfg, roles_of(model))
    assert "\n" not in str(pre.value) and expected in str(pre.value)
    with pytest.raises(TileAlignmentError, match=expected.replace("(", r"\(")):
        OrthoAdam([{"params": own, "names": ["w"]}], basis=basis, options=EngineOptions(tile_size=12))


def test_tile_grid_description_states_the_plans_per_parameter_class():
    """``describe_tile_grid`` (the reports' statement) plans through ``tile_plans``, like the pre-check: the
    sharded axis of wq gets max_shards-aligned tiles (128 / (2 x 8) = 16 for the default max_shards 8), the
    vocabulary axis stays unrotated with ``vocab_axis = identity``, ``tile_size = 0`` rotates whole axes."""
    from outlier_titan.config.job_config import Model as ModelConfig
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig
    from outlier_titan.errors import UserError
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.models.roles import roles_of
    from outlier_titan.optim.builder import build_param_groups
    from outlier_titan.optim.tile_optimizers import describe_tile_grid

    _, _, model = build_meta_model(ModelConfig(name="pre_ln", flavor="debug"), 256, 32)
    tiles = OptimizerConfig(name="orthoadam", basis="hadamard", tile_size=32, vocab_axis="identity")
    lines = describe_tile_grid(build_param_groups(model, tiles), tiles, roles_of(model))
    assert "`layers.*.attention.wq.weight` [128, 128]: 16 (8 tiles) × 32 (4 tiles)" in lines
    assert "`tok_embeddings.weight` [256, 128]: 256 unrotated × 32 (4 tiles)" in lines
    assert "`norm.weight` [128]: 16 (8 tiles)" in lines  # OrthoAdam rotates 1-D parameters (one_d = "auto")
    whole = OptimizerConfig(name="soap")
    soap_lines = describe_tile_grid(build_param_groups(model, whole), whole, roles_of(model))
    assert "`layers.*.feed_forward.w2.weight` [128, 512]: 128 (whole) × 512 (whole)" in soap_lines
    assert "`norm.weight` [128]: 128 unrotated" in soap_lines  # SOAP leaves them on Adam, as published
    adamw = OptimizerConfig(name="adamw")
    with pytest.raises(UserError, match="has no tile grid"):
        describe_tile_grid(build_param_groups(model, adamw), adamw, roles_of(model))
