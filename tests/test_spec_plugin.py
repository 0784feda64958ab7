"""A model spec written as one file outside the package (``tests/plugins/toy_spec.py``) plugs in through its entry:
it builds, trains a step, reports its rotation eligibility and its TP plan applies (FSDP-free TP 2, gloo)."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.config.job_config import Model
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import build_meta_model
from outlier_titan.models.spec import get_spec
from outlier_titan.parallel.dims import free_port
from outlier_titan.plugins import load_plugin
from tests.launch import gloo_group

TOY = str(Path(__file__).parent / "plugins" / "toy_spec.py")
VOCAB, SEQ = 256, 16


def toy_model(**options):
    load_plugin(TOY)
    spec, args, model = build_meta_model(Model(name="toy", flavor="debug"), VOCAB, SEQ)
    if options:
        args = dataclasses.replace(args, **options)
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights(Initializer(0, "cpu"))
    return spec, args, model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_the_toy_spec_builds_on_meta_and_trains_a_step():
    load_plugin(TOY)
    spec, args, model = build_meta_model(Model(name="toy", flavor="debug"), VOCAB, SEQ)
    assert spec is get_spec("toy") and type(model).__name__ == "ToyTransformer"
    assert args.embed_gain and model.embed_gain.weight.is_meta
    _, _, model = toy_model()
    logits = model(tokens())
    assert logits.shape == (2, SEQ, VOCAB)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens().flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_rotation_eligibility_comes_from_the_entry():
    from outlier_titan.quant.rotation import _residual_rotation_refusal, rotate

    spec, args, model = toy_model()
    assert _residual_rotation_refusal(model) == spec.rotation_refusal(args)
    assert "per channel" in rotate(model)[1]["residual_rotation"]
    _, _, plain = toy_model(embed_gain=False)
    assert _residual_rotation_refusal(plain) is None


def test_placement_names_are_the_ones_tensor_parallel_applies():
    from outlier_titan.models import spec
    from outlier_titan.parallel import tensor_parallel

    assert set(tensor_parallel.PLACEMENTS) == set(spec.PLACEMENTS)
    with pytest.raises(ValueError, match="placement 'diagonal'"):
        spec.TPPlan(extra={"x": "diagonal"})


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, 2, port):
        from torch.distributed.tensor import DTensor

        from outlier_titan.parallel.dims import ParallelDims
        from outlier_titan.parallel.tensor_parallel import apply_tp_plan

        load_plugin(TOY)
        mesh = ParallelDims(1, 1, 2, 2).build_mesh("cpu")
        spec, args, model = build_meta_model(Model(name="toy", flavor="debug"), VOCAB, SEQ)
        apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
        model.to_empty(device="cpu")
        model.init_weights(Initializer(0, "cpu"))
        gain = model.embed_gain.weight
        logits = model(tokens())
        torch.save({"logits": logits.full_tensor(), "gain": type(gain).__name__, "placements": str(gain.placements)
                    if isinstance(gain, DTensor) else None}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()


@pytest.mark.dist
def test_the_toy_tp_plan_applies_and_matches_one_rank(tmp_path):
    _, _, model = toy_model()
    want = model(tokens()).detach()
    mp.start_processes(_tp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["gain"] == "DTensor" and got["placements"] == "(Replicate(),)"
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-6)


def test_the_guide_shows_the_toy_spec_as_it_is():
    guide = (Path(__file__).parents[1] / "docs" / "extending.md").read_text()
    assert Path(TOY).read_text() in guide
