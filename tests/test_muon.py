"""Muon (optimizer.name = "muon"): one rank against torch.optim.Muon + torch.optim.AdamW split by hand, the
Newton-Schulz math against a plain float64 loop, the block layout's layout invariance (fake process group),
and block_periodic with muon_full_every = 1 against full."""

import copy

import pytest
import torch

from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.errors import UserError
from outlier_titan.models.pre_ln.model import PreLNArgs, PreLNTransformer
from outlier_titan.optim.builder import build_optimizer
from outlier_titan.optim.muon import MuonAdamW, muon_param_groups, newton_schulz, split_summary

STEPS = 20


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    args = PreLNArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, **kw)
    return PreLNTransformer(args).double()


def loss_of(model, step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def cfg_for(**kw):
    base = dict(name="muon", lr=2e-2, weight_decay=0.1, muon_adamw_lr=3e-3, muon_adamw_beta1=0.8,
                muon_adamw_beta2=0.97, muon_adamw_weight_decay=0.05, eps=1e-8)
    base.update(kw)
    return OptimizerConfig(**base)


def train(model, opts, steps=STEPS):
    losses = []
    for step in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = loss_of(model, step)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    return losses


def reference_opts(model, cfg):
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest, split by hand."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and name.startswith("layers.")
        if hidden:
            muon.append(p)
        elif "embeddings" in name or "norm" in name or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    assert muon and no_decay
    coefficients = tuple(float(c) for c in cfg.muon_ns_coefficients)
    opts = [torch.optim.Muon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                             nesterov=cfg.muon_nesterov, ns_coefficients=coefficients,
                             eps=cfg.muon_eps, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr_fn)]
    groups = [{"params": no_decay, "weight_decay": 0.0}]
    if decay:
        groups.append({"params": decay, "weight_decay": cfg.muon_adamw_weight_decay})
    opts.append(torch.optim.AdamW(groups, lr=cfg.muon_adamw_lr, betas=(cfg.muon_adamw_beta1, cfg.muon_adamw_beta2),
                                  eps=cfg.eps, foreach=True))
    return opts, len(muon)


@pytest.mark.parametrize("kw", [dict(), dict(muon_adjust_lr_fn="match_rms_adamw", muon_nesterov=False,
                                             muon_momentum=0.9, muon_ns_steps=3)])
@pytest.mark.parametrize("untied", [False, True])
def test_one_rank_equals_torch_muon_plus_adamw(kw, untied):
    cfg = cfg_for(**kw)
    model = small_model(tie_embeddings=not untied)
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg, seed=0)
    ref_opts, n_muon = reference_opts(ref, cfg)
    assert sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "muon") == n_muon
    got, want = train(model, [opt]), train(ref, ref_opts)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-12
    assert want[-1] < want[0]
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-12, n
    if untied:
        names = {n for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["names"]}
        assert "output.weight" in names and "tok_embeddings.weight" in names


def test_newton_schulz_equals_a_float64_loop_and_batches_per_matrix():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 20, generator=g, dtype=torch.float64)
    a, b, c = 3.4445, -4.775, 2.0315

    def plain(m):
        tall = m.shape[0] > m.shape[1]
        y = m.T if tall else m
        y = y / max(torch.linalg.matrix_norm(y).item(), 1e-7)
        for _ in range(5):
            gram = y @ y.T
            y = a * y + (b * gram + c * gram @ gram) @ y
        return y.T if tall else y

    batched = newton_schulz(x, (a, b, c), 5, 1e-7, torch.float64)
    for i in range(3):
        torch.testing.assert_close(newton_schulz(x[i], (a, b, c), 5, 1e-7, torch.float64), plain(x[i]),
                                   rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(batched[i], plain(x[i]), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(newton_schulz(x[i].T, (a, b, c), 5, 1e-7, torch.float64), plain(x[i].T),
                                   rtol=1e-12, atol=1e-13)
    # the singular values land in the quintic's band around 1 (Jordan's coefficients: about 0.7..1.2)
    s = torch.linalg.svdvals(batched)
    assert s.min() > 0.5 and s.max() < 1.3


def test_split_and_summary():
    model = small_model(tie_embeddings=False)
    groups = muon_param_groups(model, cfg_for())
    assert [g["algorithm"] for g in groups] == ["muon", "adamw", "adamw"]
    assert set(groups[0]["names"]) == {f"layers.{i}.{m}.{w}.weight" for i in range(2)
                                       for m, ws in (("attention", "qkvo"), ("feed_forward", ("1", "2")))
                                       for w in (["w" + x for x in ws])}
    assert groups[1]["names"] == ["output.weight"]
    line = split_summary(groups)
    assert line.startswith("optimizer split: muon 12 tensors") and "lr 0.02" in line and "lr 0.003" in line


def test_bad_options_raise_user_errors():
    model = small_model()
    with pytest.raises(UserError, match="muon_layout"):
        build_optimizer(model, cfg_for(muon_layout="rows"), 0)
    with pytest.raises(UserError, match="muon_full_every"):
        build_optimizer(model, cfg_for(muon_layout="block_periodic", muon_full_every=0), 0)
    with pytest.raises(UserError, match="muon_ns_coefficients"):
        build_optimizer(model, cfg_for(muon_ns_coefficients=[1.0, 2.0]), 0)
    with pytest.raises(UserError, match="muon_ns_coefficients"):
        build_optimizer(model, cfg_for(muon_ns_coefficients=["a", "2", "3"]), 0)
    with pytest.raises(UserError, match="muon_ns_steps"):
        opt = build_optimizer(model, cfg_for(muon_ns_steps=0), 0)
        loss_of(model, 0).backward()
        opt.step()


# ------------------------------------------------------------------------------------------------------------
# Layouts on plain tensors and on simulated DTensor shards


def _groups(params, names, lr=2e-2):
    hidden = [n for n in names if params[n].ndim == 2 and n.startswith("layers.")]
    rest = [n for n in names if n not in hidden]
    return [{"params": [params[n] for n in hidden], "names": hidden, "algorithm": "muon", "lr": lr,
             "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.775, 2.0315),
             "ns_steps": 5, "eps": 1e-7, "adjust_lr_fn": "original"},
            {"params": [params[n] for n in rest], "names": rest, "algorithm": "adamw", "lr": 3e-3,
             "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}]


def _run_plain(layout, steps, full_every=1, ns_dtype="float64", per_head=None):
    from outlier_titan.optim.tiles.options import EngineOptions
    from tests.test_optim_layouts import SPEC, full_grads, full_params

    names = [n for n, _ in SPEC]
    params = {n: torch.nn.Parameter(t.clone()) for n, t in full_params().items()}
    opt = MuonAdamW(_groups(params, names), layout=layout, full_every=full_every, ns_dtype=ns_dtype,
                    per_head=per_head, options=EngineOptions(tile_size=4, shard_tile_size=4))
    for grads in full_grads(steps):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def test_block_periodic_every_1_equals_full_and_every_k_interleaves_full_and_block_steps():
    full, block = _run_plain("full", 4), _run_plain("block", 4)
    bp1, bp2 = _run_plain("block_periodic", 4, full_every=1), _run_plain("block_periodic", 4, full_every=2)
    for n in full:
        assert torch.equal(bp1[n], full[n]), n
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(block[wq], full[wq]) and not torch.equal(bp2[wq], full[wq])
    assert not torch.equal(bp2[wq], block[wq])
    # step 1 of block_periodic is a full step
    one_full, one_bp = _run_plain("full", 1), _run_plain("block_periodic", 1, full_every=3)
    assert all(torch.equal(one_full[n], one_bp[n]) for n in one_full)


def test_block_tiles_are_orthogonalised_separately_with_their_own_lr_scale():
    from outlier_titan.optim.tiles.options import EngineOptions

    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(8, 12, dtype=torch.float64))
    grad = torch.randn(8, 12, generator=g, dtype=torch.float64)
    group = _groups({"layers.0.feed_forward.w1.weight": w}, ["layers.0.feed_forward.w1.weight"], lr=0.1)[0]
    group.update(momentum=0.0, nesterov=False, weight_decay=0.0)
    opt = MuonAdamW([group], layout="block", ns_dtype="float64", options=EngineOptions(tile_size=8, shard_tile_size=4))
    w.grad = grad.clone()
    opt.step()
    want = torch.zeros_like(grad)
    for r in (0, 4):  # row tiles of 4 (the sharded axis), column tiles of 8 and a ragged 4
        for c, edge in ((0, 8), (8, 4)):
            blk = grad[r:r + 4, c:c + edge]
            want[r:r + 4, c:c + edge] = -0.1 * max(1, 4 / edge) ** 0.5 * newton_schulz(
                blk, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float64)
    torch.testing.assert_close(w.detach(), want, rtol=1e-12, atol=1e-14)


def test_per_head_orthogonalises_each_heads_rows():
    model = small_model()
    cfg = cfg_for(muon_per_head=True, muon_momentum=0.0, muon_nesterov=False, weight_decay=0.0,
                  muon_ns_dtype="float64")
    opt = build_optimizer(model, cfg, 0)
    assert "per head (6 matrices)" in opt.describe()
    wq = model.layers["0"].attention.wq.weight
    before = wq.detach().clone()
    loss_of(model, 0).backward()
    grad = wq.grad.clone()
    opt.step()
    heads = newton_schulz(grad.reshape(4, 8, 32), (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float64)
    torch.testing.assert_close(wq.detach(), before - cfg.lr * heads.reshape(32, 32), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", ["fsdp2xtp2", "hsdp", "fsdp4"])
def test_block_layout_is_layout_invariant(layout):
    """block: every rank of FSDP 4 / FSDP 2 x TP 2 / HSDP 2 x 2 (fake process group, no communication) gives
    the one-process numbers bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from outlier_titan.optim.tiles.options import EngineOptions
    from outlier_titan.optim.tiles.shards import local_indices
    from tests.test_optim_layouts import MESHES, SPEC, _put, fake_rank, full_grads, full_params, placements

    steps = 3
    ref = _run_plain("block", steps)
    names = [n for n, _ in SPEC]
    mesh_shape = MESHES[layout]
    world = 1
    for s in mesh_shape:
        world *= s
    got = {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in SPEC}
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape,
                                    mesh_dim_names=tuple(f"m{rank}d{i}" for i in range(len(mesh_shape))))
            coord = mesh.get_coordinate()
            place = {n: placements(layout, n, t.dim()) for n, t in full_params().items()}
            params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, place[n], src_data_rank=None))
                      for n, t in full_params().items()}
            opt = MuonAdamW(_groups(params, names), layout="block", ns_dtype="float64",
                            options=EngineOptions(tile_size=4, shard_tile_size=4))
            for grads in full_grads(steps):
                for n, p in params.items():
                    p.grad = distribute_tensor(grads[n], mesh, place[n], src_data_rank=None)
                opt.step()
            for n, shape in SPEC:
                shape2 = shape if len(shape) == 2 else (shape[0], 1)
                idx = [local_indices(shape2[a], a, mesh_shape, place[n], coord) for a in range(2)]
                _put(got[n], params[n].to_local(), *idx)
    for n in ref:
        assert torch.equal(got[n], ref[n]), (n, (got[n] - ref[n]).abs().max())


def test_dry_run_prints_the_split_and_counts_muon_state_bytes(capsys):
    from pathlib import Path

    from outlier_titan.config.manager import parse_args
    from outlier_titan.training.planning import dry_run

    debug = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml")
    cfg = parse_args(["--config", debug, "--job.dry_run", "true", "--parallelism.dp_shard", "2",
                      "--optimizer.name", "muon", "--optimizer.muon_layout", "block"])
    pl = dry_run(cfg)
    out = capsys.readouterr().out
    assert "optimizer split: muon 24 tensors (786,432 elements" in out and "muon_layout block" in out
    muon_local = 786_432 // 2  # 4 blocks x (4 x 128 x 128 + 2 x 512 x 128), rows or columns halved
    assert pl.optimizer_bytes == 4 * muon_local + 8 * (pl.local_params - muon_local)
