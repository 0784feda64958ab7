"""An attention variant as one plug-in file (tests/plugins/toy_attention.py): loaded by job.plugins' loader, it is a
``model.attention`` choice with its option in ``[model]`` and ``--help``, a debug model builds with it (its module,
optimizer class and TP placement as declared), and its forward on the default (chunked) and probe (explicit) paths
equals its formula in float64 (values and gradients). It runs in a fresh interpreter, as an entry point loads
plug-ins there (after the built-ins and the model code)."""

import subprocess
import sys
import textwrap

from tests.launch import REPO

PLUGIN = REPO / "tests" / "plugins" / "toy_attention.py"

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import outlier_titan.components
    from outlier_titan.config.manager import help_text
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import model_args
    from outlier_titan.optim.params import trainable_params
    from outlier_titan.parallel.tensor_parallel import ShardedParams, tp_block_plan
    from outlier_titan.plugins import load_plugin

    load_plugin(sys.argv[1])  # after the built-ins and the model code (as job.plugins does): its option joins [model]
    from outlier_titan.config.job_config import Model

    text = help_text()
    assert "toy_temperature (softmax at a learned temperature (toy plug-in))" in text
    assert "options of attention variant 'toy_temperature':" in text and "--model.attention_toy_temperature" in text
    spec, args = model_args(Model(name="pre_ln", flavor="debug", attention="toy_temperature",
                                  attention_toy_temperature=4.0), 256, 40)
    model = spec.build(args)
    model.init_weights(Initializer(0, torch.device("cpu")))
    classes = {n: c for n, c, _ in trainable_params(model)}
    assert classes["layers.0.attention.toy_scale.weight"] == "gain"
    assert isinstance(tp_block_plan(model.layers["0"])["attention.toy_scale"], ShardedParams)
    att = model.layers["0"].attention.double()
    assert torch.equal(att.toy_scale.weight, torch.full_like(att.toy_scale.weight, 0.25))
    with torch.no_grad():
        att.toy_scale.weight.copy_(torch.linspace(-0.5, 2.0, att.toy_scale.weight.numel()))

    def reference(x):
        q, k, v = att.project_qkv(x)
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        out = torch.zeros_like(q)
        g = att.toy_scale.weight.view(1, -1, 1)
        for i in range(q.shape[2]):
            s = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]) * q.shape[-1] ** -0.5
            w = torch.exp(g * s) / torch.exp(g * s).sum(-1, keepdim=True)
            out[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, : i + 1])
        return att.project_out(out)

    x = torch.randn(2, 40, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    ref = reference(x)
    got = att(x)
    assert (got - ref).abs().max().item() < 1e-10
    up = torch.randn_like(ref)
    inputs = [x, att.toy_scale.weight, att.wq.weight]
    for g, r in zip(torch.autograd.grad(got, inputs, up), torch.autograd.grad(ref, inputs, up)):
        assert torch.isfinite(g).all() and (g - r).abs().max().item() < 1e-10
    x = x.detach()
    seen = []
    att.prob_hook = seen.append
    assert (att(x) - ref.detach()).abs().max().item() < 1e-10
    assert seen[0].shape == (2, args.n_heads, 40, 40) and torch.allclose(seen[0].sum(-1), torch.ones(()).double())
    att.prob_hook = None
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model.double()(tokens)).all()
    print("ok")
""")


def test_a_one_file_attention_plugin_trains_and_probes():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(PLUGIN)], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]

