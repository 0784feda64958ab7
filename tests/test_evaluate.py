"""Evaluation: perplexity, the validation token budget (each token once), the per-scheme report with its progress
bar, and scripts/evaluate.py."""

from __future__ import annotations

import importlib
import io
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from outlier_titan.config.job_config import Model
from outlier_titan.eval.perplexity import perplexity, take_batches, validation_budget
from outlier_titan.eval.report import markdown
from outlier_titan.eval.runner import evaluate_model
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.provenance import code_version
from outlier_titan.quant.ptq import SCHEMES



def load_script(name: str):
    """The tool module behind ``scripts/<name>.py`` (``outlier_titan.tools.<name>``)."""
    return importlib.import_module(f"outlier_titan.tools.{name}")


class Uniform(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens):
        return torch.zeros(*tokens.shape, self.vocab)


def batches(n: int, b: int = 4, t: int = 8, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        w = torch.randint(0, vocab, (b, t + 1), generator=g)
        yield w[:, :-1], w[:, 1:]


def test_uniform_model_perplexity_is_vocab_size():
    res = perplexity(Uniform(50), list(batches(3, vocab=50)), "cpu")
    assert res.tokens == 3 * 4 * 8
    assert res.ppl == pytest.approx(50.0, rel=1e-6)  # float32 log-softmax per token
    assert res.loss == pytest.approx(math.log(50.0), rel=1e-7)


def test_take_batches_cuts_to_whole_rows():
    got = take_batches(batches(10), 20)  # 8 tokens a row: 3 rows reach 20
    assert [x.shape for x, _ in got] == [(3, 8)]
    got = take_batches(batches(10), 40)  # 32 from the first batch, then 1 row
    assert [x.shape[0] for x, _ in got] == [4, 1]
    with pytest.raises(ValueError):
        take_batches(batches(1), 0)


def test_small_validation_split_is_scored_once_whole(tmp_path, capsys):
    """A split smaller than the budget: every window once (count = the split's predicted tokens), a warning."""
    from outlier_titan.config.job_config import Data
    from outlier_titan.data import build_dataloader, build_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * 10)
    tok = build_tokenizer("embedded")
    cfg = Data(source=str(corpus), val_fraction=0.5, cache_dir=str(tmp_path / "cache"))
    seq_len = 16
    val = build_dataloader(cfg, tok, split="validation", seq_len=seq_len, global_batch_size=4, micro_batch_size=4,
                           dp_rank=0, dp_degree=1)
    n_split = int(val.cache_info["tokens"])
    windows = (n_split - 1) // seq_len
    assert windows == val.num_windows and windows >= 5
    budget = validation_budget(val, seq_len, 65536, "--tokens")
    assert "fewer than the 65,536 asked by --tokens" in capsys.readouterr().err
    got = take_batches(val, budget)
    scored = sum(labels.numel() for _, labels in got)
    assert scored == budget == windows * seq_len and scored <= n_split - 1
    labels = torch.cat([lab for _, lab in got]).flatten()
    stream = torch.from_numpy(np.load(val.cache_path).astype(np.int64))
    assert torch.equal(labels, stream[1:1 + scored])  # each predicted token once, in order, no wrap-around
    assert validation_budget(val, seq_len, 32, "--tokens") == 32 and capsys.readouterr().err == ""


def debug_model():
    spec, args = model_args(Model(name="pre_ln", flavor="debug"), vocab_size=256, seq_len=16)
    m = spec.build(args)
    m.init_weights(Initializer(0, "cpu"))
    return m


def test_evaluate_model_reports_every_scheme():
    m = debug_model()
    evals = list(batches(2, b=4, t=16, vocab=256))
    calls = []

    def calib(seed):
        calls.append(seed)
        return [x for x, _ in batches(2, b=2, t=16, vocab=256, seed=100 + seed)]

    s = io.StringIO()
    report, images = evaluate_model(m, eval_batches=evals, probe_tokens=[evals[0][0]], calib_batches=calib,
                                    calib_seeds=(0, 1), stream=s)
    fp = report["full_precision"]["ppl"]
    assert fp == pytest.approx(perplexity(m, evals, "cpu").ppl, rel=1e-12)
    assert [e["scheme"] for e in report["schemes"]] == list(SCHEMES)
    for e in report["schemes"]:
        assert math.isfinite(e["ppl"]) and e["delta"] == pytest.approx(e["ppl"] - fp)
        # quantisation changes the model; a model edit (super weights) only where it finds its target
        assert e["ppl"] != fp or (SCHEMES[e["scheme"]].edit and e["edit"][0]["zeroed"] == []), e["scheme"]
    w8 = next(e for e in report["schemes"] if e["scheme"] == "w8a8_static")
    assert len(w8["ppl_runs"]) == 2 and w8["head"] == "fp (tied to the embedding)"
    assert calls == [0, 1] * sum(SCHEMES[n].calibrate for n in SCHEMES)
    for e in report["schemes"]:  # calibrated and rotated schemes run once per seed
        assert len(e["ppl_runs"]) == (2 if SCHEMES[e["scheme"]].seeded else 1), e["scheme"]
        assert ("rotation" in e) == SCHEMES[e["scheme"]].rotate, e["scheme"]
    rot = next(e for e in report["schemes"] if e["scheme"] == "w4a4kv4_rtn_hadamard")
    assert rot["head"] == "fp" and "randomised Hadamard 128" in rot["rotation"]["residual_rotation"]
    assert rot["rotation"]["seeds"] == [0, 1] and "seed" not in rot["rotation"]["residual_rotation"]
    assert "outliers/kurtosis_first" in report["probe"] and "outliers/attention_map" in images
    # the gradient-side metrics (observe.gradients) and the sinks-vs-massive panel are part of the evaluation
    assert 0 < report["probe"]["outliers/grad_sink_share"] < 1 and "outliers/sinks_vs_massive" in images
    progress = s.getvalue()  # one tqdm bar over full precision + every scheme run (2 seeds for seeded schemes)
    # (one bar: closed once; its last refresh may repeat at close when the final update was drawn)
    assert progress.count("\n") == 1 and progress.count("0.00/") == 1
    assert progress.rstrip().split("\r")[-1].startswith(f"{list(SCHEMES)[-1]} (calibration seed 1): 100%")
    assert "w4a4kv4_rtn_hadamard (rotation seed 1)" in progress
    # the model is restored after every scheme
    assert perplexity(m, evals, "cpu").ppl == pytest.approx(fp, rel=1e-12)
    table = markdown({**report, "checkpoint": "x/step-1"})
    for name in SCHEMES:
        assert f"| {name} |" in table
    assert "| full precision |" in table and " ± " in table and "| kurtosis_first |" in table
    assert "; rotation seeds 0, 1." in table
    assert ("| layer | sink_rate | first_token_attention_mass | massive_ratio | max_abs_first | massive_t0_early | "
            "grad_sink_share | grad_sink_rgs |") in table and "| grad_sink_share |" in table


def test_evaluate_script_user_errors(tmp_path, capsys):
    ev = load_script("evaluate")
    assert ev.main(["--checkpoint", str(tmp_path / "missing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert ev.main(["--checkpoint", str(tmp_path), "--schemes", "int3"]) == 2
    assert "unknown int3" in capsys.readouterr().err


@pytest.mark.dist
def test_evaluate_script_on_a_real_fsdp_checkpoint(tmp_path, capsys):
    """train.py on 2 FSDP ranks writes a DCP checkpoint; scripts/evaluate.py loads it at world size 1 from the
    run folder and writes JSON + markdown + pictures."""
    import json

    from outlier_titan.checkpoint import load_model_for_eval
    from tests.launch import TINY, train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    for i in range(6):
        idx = torch.randint(0, len(words), (3000,), generator=g).tolist()
        (corpus / f"doc{i}.txt").write_text(" ".join(words[j] for j in idx))
    run = train(tmp_path, *TINY, "--training.steps", "3", "--checkpoint.enable", "true", "--data.source",
                str(corpus), "--data.val_fraction", "0.5", "--data.cache_dir", str(tmp_path / "cache"),
                "--observe.batch_size", "2", "--training.seq_len", "32", nproc=2).check()
    ckpt = run.run_dir / "checkpoints" / "step-3"
    model, cfg, tok = load_model_for_eval(ckpt)
    assert cfg.training.seq_len == 32 and not any(p.is_meta for p in model.parameters())

    ev = load_script("evaluate")
    rc = ev.main(["--checkpoint", str(run.run_dir), "--tokens", "200", "--batch-size", "4", "--calib-batches", "2",
                  "--calib-seeds", "2", "--schemes", "int8_fine,int4_zeropoint,w8a8_static", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    report = json.loads((run.run_dir / "eval" / "step-3.json").read_text())
    assert report["step"] == 3 and report["tokens"] == 224 and report["seq_len"] == 32  # 7 rows of 32
    assert report["code"] == code_version()  # the code that evaluated it
    assert [e["scheme"] for e in report["schemes"]] == ["int8_fine", "int4_zeropoint", "w8a8_static"]
    assert len(report["schemes"][2]["ppl_runs"]) == 2
    assert 1 < report["full_precision"]["ppl"] < tok.vocab_size
    table = (run.run_dir / "eval" / "step-3.md").read_text()
    assert table in out.out and "| int4_zeropoint |" in table
    assert (run.run_dir / "eval" / "step-3.attention_map.png").is_file()
    assert (run.run_dir / "eval" / "step-3.hidden_magnitude.png").is_file()
    assert (run.run_dir / "eval" / "step-3.sinks_vs_massive.png").is_file()
    assert "outliers/layer_0/grad_sink_share" in report["probe"] and "| grad_sink_share |" in table
    assert "w8a8_static (calibration seed 1)" in out.err

    # --update: re-run some schemes into that report, keeping the others; refused on other settings
    before = report
    picture = (run.run_dir / "eval" / "step-3.attention_map.png").stat().st_mtime_ns
    rc = ev.main(["--checkpoint", str(run.run_dir), "--tokens", "200", "--batch-size", "4", "--calib-batches", "2",
                  "--calib-seeds", "2", "--schemes", "w4a4kv4_rtn_hadamard,int8_fine", "--device", "cpu", "--update"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((run.run_dir / "eval" / "step-3.json").read_text())
    assert [e["scheme"] for e in report["schemes"]] == ["int8_fine", "int4_zeropoint", "w8a8_static",
                                                        "w4a4kv4_rtn_hadamard"]
    assert report["schemes"][:3] == before["schemes"]  # int8_fine is deterministic: re-run to the same numbers
    assert report["updated"][0]["schemes"] == ["w4a4kv4_rtn_hadamard", "int8_fine"]
    assert report["updated"][0]["code"] == report["code"] == code_version()
    # the probe is not re-run: its numbers and pictures stay the first evaluation's
    assert report["probe"] == before["probe"] and report["osp_kurtosis"] == before["osp_kurtosis"]
    assert (run.run_dir / "eval" / "step-3.attention_map.png").stat().st_mtime_ns == picture
    assert "| w4a4kv4_rtn_hadamard |" in (run.run_dir / "eval" / "step-3.md").read_text()
    capsys.readouterr()
    assert ev.main(["--checkpoint", str(run.run_dir), "--tokens", "100", "--batch-size", "4", "--calib-batches",
                    "2", "--calib-seeds", "2", "--schemes", "int8_fine", "--device", "cpu", "--update"]) == 2
    err = capsys.readouterr().err
    assert "other evaluation settings (tokens 224 -> 128; tokens_requested 200 -> 100)" in err and "int8_fine" not in err
    assert ev.main(["--checkpoint", str(run.run_dir), "--schemes", "int8_fine", "--device", "cpu", "--update",
                    "--out", str(tmp_path / "none.json")]) == 2
    assert "no report at" in capsys.readouterr().err
    assert json.loads((run.run_dir / "eval" / "step-3.json").read_text()) == report  # refusals change nothing
