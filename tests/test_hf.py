"""Hugging Face interop: import (logits equal transformers'), export (transformers loads it), bad folders."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from outlier_titan.errors import UserError  # noqa: E402
from outlier_titan.hf.export import export_model  # noqa: E402
from outlier_titan.hf.folders import read_hf_tensors  # noqa: E402
from outlier_titan.hf.load import import_hf, load_pretrained  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 4096  # the embedded tokenizer's vocabulary, so imported models can read the embedded corpus


def tiny_gpt2(folder: Path, tie: bool = True, **kw) -> Path:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  tie_word_embeddings=tie, **kw)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    _randomize(model)
    model.save_pretrained(folder)
    return folder


def tiny_llama(folder: Path, tie: bool = False, **kw) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tie, **kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    _randomize(model)
    model.save_pretrained(folder)
    return folder


def _randomize(model) -> None:
    # Norm gains and biases start at 1/0; random values make a swapped or mistransposed weight visible.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.abs().sum() == p.numel() else 0.0))


def hf_logits(folder: Path, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is not None and dtype == torch.float64:
        _float64_rope(rot)
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                _float64_rmsnorm(m)
    with torch.no_grad():
        return model(tokens).logits


def _float64_rope(rot) -> None:
    """HF computes RoPE tables in float32 whatever the model dtype; in float64 the same formula, for 1e-10."""
    dim = rot.inv_freq.numel() * 2
    inv = 1.0 / (rot.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rot.forward = forward


def _float64_rmsnorm(norm) -> None:
    """HF's RMSNorm also computes in float32 whatever the dtype; the same formula in the input's dtype."""

    def forward(x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    norm.forward = forward


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_import_logits_match_transformers(tmp_path, family, dtype, tol):
    folder = (tiny_gpt2 if family == "gpt2" else tiny_llama)(tmp_path / family)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    ours, model_cfg = import_hf(folder, dtype=dtype)
    if family == "llama":
        assert model_cfg.n_kv_heads == 2 and model_cfg.n_heads == 4 and model_cfg.pos_encoding == "rope"
    with torch.no_grad():
        got = ours(tokens)
    want = hf_logits(folder, tokens, dtype)
    assert got.dtype == dtype
    err = (got - want).abs().max().item()
    assert err < tol * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("family,tie", [("gpt2", False), ("llama", True)])
def test_import_other_head_tying(tmp_path, family, tie):
    folder = (tiny_gpt2 if family == "gpt2" else tiny_llama)(tmp_path / family, tie=tie)
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    ours, model_cfg = import_hf(folder, dtype=torch.float64)
    assert model_cfg.tie_embeddings is tie
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf_logits(folder, tokens, torch.float64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_of_import_round_trips_through_transformers(tmp_path, family):
    folder = (tiny_gpt2 if family == "gpt2" else tiny_llama)(tmp_path / family)
    fmt, files = export_model(folder, tmp_path / "out", "hf", max_shard_bytes=40_000)
    assert fmt == "hf" and (tmp_path / "out" / "model.safetensors.index.json") in files and len(files) > 3
    original, exported = read_hf_tensors(folder), read_hf_tensors(tmp_path / "out")
    assert set(exported) <= set(original)
    for k, v in exported.items():
        assert torch.equal(v, original[k]), k
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(hf_logits(tmp_path / "out", tokens, torch.float32),
                          hf_logits(folder, tokens, torch.float32), rtol=0, atol=1e-5)


def test_sharded_hf_folder_is_read(tmp_path):
    folder = tiny_llama(tmp_path / "one")
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, _ = import_hf(folder)
    b, _ = import_hf(tmp_path / "sharded")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


# ---------------------------------------------------------------- bad inputs

def _run_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), *args], capture_output=True,
                          text=True, timeout=120)


def _one_line_exit2(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def _export_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """scripts/export.py's main in this process (a subprocess per case costs a torch import each)."""
    from tests.test_evaluate import load_script

    capsys.readouterr()  # drop earlier output (transformers' progress bars)
    code = load_script("export").main(list(args))
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def test_bad_hf_folders_are_one_line_errors(tmp_path, capsys):
    folder = tiny_gpt2(tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())

    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({**cfg, "activation_function": "gelu"}))
    (unsupported / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    _one_line_exit2(_run_export(str(unsupported), "--out", str(tmp_path / "o1")), "activation_function", "'gelu'")

    arch = tmp_path / "arch"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    _one_line_exit2(_export_main(capsys, str(arch), "--out", str(tmp_path / "o2")), "model_type = 'mistral'")

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(cfg))
    _one_line_exit2(_export_main(capsys, str(missing), "--out", str(tmp_path / "o3")), "no model.safetensors")

    from safetensors.torch import save_file
    tensors = read_hf_tensors(folder)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if "h.1.mlp" not in k}, str(partial / "model.safetensors"))
    _one_line_exit2(_export_main(capsys, str(partial), "--out", str(tmp_path / "o4")), "missing", "h.1.mlp")

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({**cfg, "n_inner": 64}))
    (shape / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    _one_line_exit2(_export_main(capsys, str(shape), "--out", str(tmp_path / "o5")), "shape", "mlp.c_fc")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_hf_folder_without_tokenizer_needs_one(tmp_path):
    folder = tiny_gpt2(tmp_path / "gpt2")
    with pytest.raises(UserError, match="--tokenizer"):
        load_pretrained(folder)
    model, cfg, tok = load_pretrained(folder, tokenizer="embedded")
    assert tok.vocab_size == VOCAB and cfg.model.dim == 32


# ---------------------------------------------------------------- export of our checkpoints

@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("flavor,nproc,layout", [("debug_llama", 4, ["--parallelism.tp", "2"]), ("debug", 2, [])])
def test_export_of_a_distributed_checkpoint_loads_in_transformers(tmp_path, flavor, nproc, layout):
    from tests.launch import TINY, train

    run = train(tmp_path, *TINY, "--training.steps", "3", "--checkpoint.enable", "true", "--model.flavor", flavor,
                "--model.n_layers", "2", "--training.seq_len", "32", *layout, nproc=nproc).check()
    fmt, _ = export_model(run.run_dir, tmp_path / "hf", "auto")
    assert fmt == "hf" and (tmp_path / "hf" / "tokenizer.tiktoken").is_file()
    ours, _, _ = load_pretrained(run.run_dir)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(tokens)
    got = hf_logits(tmp_path / "hf", tokens, torch.float32)
    assert (got - want).abs().max().item() < 1e-5
    # The export reads back into our stack with its own tokenizer, and as a run's starting point.
    again, _, tok = load_pretrained(tmp_path / "hf")
    assert tok.vocab_size == VOCAB
    with torch.no_grad():
        assert torch.allclose(again(tokens), want, rtol=0, atol=1e-5)


def _save_dcp_checkpoint(run_dir: Path, overrides: list[str]) -> torch.nn.Module:
    """A world-size-1 DCP checkpoint of a freshly initialised model, laid out as a run's (config.toml beside it)."""
    import torch.distributed.checkpoint as dcp

    from outlier_titan.config.manager import parse_args, to_toml
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import build_meta_model

    cfg = parse_args(["--config", str(REPO / "train_configs" / "debug.toml"), "--training.seq_len", "32",
                      "--model.n_layers", "2", *overrides])
    spec, _, model = build_meta_model(cfg.model, build_tokenizer(cfg.data.tokenizer).vocab_size, 32)
    model.to_empty(device="cpu")
    model.init_weights(Initializer(7, "cpu"))
    if spec.post_step is not None:
        spec.post_step(model)
    ckpt = run_dir / "checkpoints" / "step-1"
    with warnings.catch_warnings():  # one process is the intent here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return model.eval()


@pytest.mark.parametrize("spec", ["op", "angpt", "ngpt", "softmax1"])
def test_specs_hf_lacks_export_to_safetensors_and_round_trip(tmp_path, spec):
    overrides = ["--model.softmax", "softmax1"] if spec == "softmax1" else ["--model.name", spec]
    model = _save_dcp_checkpoint(tmp_path / "run", overrides)
    fmt, files = export_model(tmp_path / "run", tmp_path / "out", "auto")
    assert fmt == "safetensors" and {f.name for f in files} == {"model.safetensors", "config.toml",
                                                               "tokenizer.tiktoken"}
    back, cfg, _ = load_pretrained(tmp_path / "out")
    assert cfg.model.name == ("pre_ln" if spec == "softmax1" else spec)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))


def test_export_to_hf_of_a_model_hf_lacks_is_refused(tmp_path):
    _save_dcp_checkpoint(tmp_path / "run", ["--model.softmax", "softmax1"])
    with pytest.raises(UserError, match="attention variant softmax1 .*--format safetensors"):
        export_model(tmp_path / "run", tmp_path / "out", "hf")
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        export_model(tmp_path / "run", tmp_path / "out", "safetensors")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


# Loads an HF folder in a fresh process (transformers warns once per process) with Python warnings as errors and
# transformers' own warnings (its logger) collected; prints the generation config's BOS / EOS ids.
LOAD_WITHOUT_WARNINGS = """
import logging, sys, warnings
warnings.simplefilter("error")
import transformers
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
transformers.logging.get_logger().addHandler(Keep(logging.WARNING))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(model.generation_config.bos_token_id, model.generation_config.eos_token_id)
sys.exit("transformers warned: " + " | ".join(said) if said else 0)
"""


@pytest.mark.parametrize("source", ["debug", "debug_llama", "hf folder without a tokenizer"])
def test_export_carries_our_special_tokens_and_loads_without_warnings(tmp_path, source):
    if source.startswith("hf"):
        folder, eos = tiny_gpt2(tmp_path / "gpt2"), None
    else:
        folder, eos = tmp_path / "run", 4095  # the embedded BPE's <|endoftext|>
        _save_dcp_checkpoint(folder, ["--model.flavor", source])
    assert export_model(folder, tmp_path / "out", "hf")[0] == "hf"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == eos
    load = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_WARNINGS, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.split() == [str(eos)] * 2


def _corpus(folder: Path, n_docs: int = 6, words: int = 3000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    vocab = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta", "\n", "def", "x = 1"]
    for i in range(n_docs):
        idx = torch.randint(0, len(vocab), (words,), generator=g).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(vocab[j] for j in idx))
    return folder


def test_evaluate_hf_writes_the_full_report(tmp_path, capsys):
    from outlier_titan.quant.ptq import SCHEMES
    from tests.test_evaluate import load_script

    folder = tiny_llama(tmp_path / "llama")
    corpus = _corpus(tmp_path / "corpus")
    capsys.readouterr()
    rc = load_script("evaluate").main(["--hf", str(folder), "--tokenizer", "embedded", "--data", str(corpus),
                                       "--tokens", "128", "--batch-size", "2", "--seq-len", "32",
                                       "--calib-batches", "1", "--calib-seeds", "2", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    report = json.loads((folder / "eval" / "model.json").read_text())
    assert [e["scheme"] for e in report["schemes"]] == list(SCHEMES)
    assert report["tokens"] == 128 and report["seq_len"] == 32
    assert "outliers/kurtosis_neuron_rms" in report["probe"] and "outliers/first_token_argmax_share" in report["probe"]
    assert (folder / "eval" / "model.md").read_text() in out.out
    assert (folder / "eval" / "model.attention_map.png").is_file()
    assert (folder / "eval" / "model.hidden_magnitude.png").is_file()
    assert load_script("evaluate").main(["--hf", str(folder)]) == 2
    assert "--tokenizer" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.slow
def test_training_starts_from_an_imported_model(tmp_path):
    """train.py on 2 FSDP ranks with checkpoint.initial_load_path = an HF folder: the model shape comes from the
    folder and the step-1 loss (before any update) is the imported model's loss on the same first batch."""
    import torch.nn.functional as F

    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_dataloader, build_tokenizer
    from tests.launch import TINY, train

    folder = tiny_llama(tmp_path / "llama")
    corpus = _corpus(tmp_path / "corpus")
    data = ["--data.source", str(corpus), "--data.cache_dir", str(tmp_path / "cache")]
    run = train(tmp_path, *TINY, "--training.steps", "2", "--training.seq_len", "32", *data,
                "--checkpoint.initial_load_path", str(folder), nproc=2).check()
    saved = parse_args(["--config", str(run.run_dir / "config.toml")])
    assert (saved.model.dim, saved.model.n_kv_heads, saved.model.mlp) == (32, 2, "swiglu")

    model, _ = import_hf(folder)
    cfg = parse_args(["--config", str(REPO / "train_configs" / "debug.toml"), *data])
    loader = build_dataloader(cfg.data, build_tokenizer("embedded"), seq_len=32, global_batch_size=8,
                              micro_batch_size=8, dp_rank=0, dp_degree=1, split="train", seed=0)
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert run.losses[1] == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------- pre-tokenized shards

def _many_docs(folder: Path) -> Path:
    """A multi-file corpus: two jsonl files of many documents and a few txt files."""
    _corpus(folder, n_docs=4, words=800)
    g = torch.Generator().manual_seed(1)
    for name in ("a.jsonl", "sub/b.jsonl"):
        (folder / name).parent.mkdir(exist_ok=True)
        lines = [json.dumps({"text": " ".join(["w%d" % i for i in torch.randint(0, 50, (40,), generator=g)])})
                 for _ in range(150)]
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def test_shards_hold_the_raw_token_stream_and_check_the_tokenizer(tmp_path):
    from outlier_titan.config.job_config import Data
    from outlier_titan.data import build_dataloader, build_tokenizer
    from outlier_titan.data.loader import token_cache
    from outlier_titan.data.pretokenized import open_split, pretokenize
    from outlier_titan.data.sources import resolve_source
    from outlier_titan.errors import DataError

    corpus = _many_docs(tmp_path / "corpus")
    manifest = pretokenize(str(corpus), "embedded", tmp_path / "shards", workers=2, shard_tokens=4000,
                           progress=False)
    tok = build_tokenizer("embedded")
    for split in ("train", "validation"):
        raw, _ = token_cache(resolve_source(str(corpus), split), tok, tmp_path / "cache")
        raw = np.load(raw)
        shards, _ = open_split(tmp_path / "shards", split, tok)
        assert np.array_equal(shards[0:len(shards)], raw)
        assert np.array_equal(shards[3990:4017], raw[3990:4017])  # train: a slice across a shard boundary
        entry = manifest["splits"][split]
        assert entry["tokens"] == len(raw) == sum(s["tokens"] for s in entry["shards"])
    assert len(manifest["splits"]["train"]["shards"]) > 2 and manifest["splits"]["train"]["documents"] > 300

    other = tmp_path / "bytes.tiktoken"  # a valid BPE file with no merges: another tokenizer
    other.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    with pytest.raises(DataError, match=r"tokenized with 'embedded'.*set data.tokenizer"):
        build_dataloader(Data(source=str(tmp_path / "shards")), build_tokenizer(str(other)), seq_len=16,
                         global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_degree=1)
    with pytest.raises(DataError, match=r"data.val_fraction = 0.1 but .* split with 0.02"):
        build_dataloader(Data(source=str(tmp_path / "shards"), val_fraction=0.1), tok, seq_len=16,
                         global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_degree=1)
    rows = next(iter(build_dataloader(Data(source=str(tmp_path / "shards")), tok, seq_len=16, global_batch_size=2,
                                      micro_batch_size=2, dp_rank=0, dp_degree=1, split="validation")))[0]
    assert rows.shape == (2, 16)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.extended
def test_shards_train_to_the_same_losses_as_raw_files(tmp_path):
    from tests.launch import TINY, assert_losses_close, train

    corpus = _many_docs(tmp_path / "corpus")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "pretokenize.py"), str(corpus), "--tokenizer",
                           "embedded", "--out", str(tmp_path / "shards"), "--workers", "2", "--shard-tokens", "4000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "pretokenize train" in proc.stderr  # the tqdm bar
    common = [*TINY, "--training.seq_len", "32", "--data.cache_dir", str(tmp_path / "cache")]
    raw = train(tmp_path, *common, "--data.source", str(corpus), name="raw").check()
    one = train(tmp_path, *common, "--data.source", str(tmp_path / "shards"), name="one").check()
    two = train(tmp_path, *common, "--data.source", str(tmp_path / "shards"), name="two", nproc=2).check()
    assert len(raw.losses) == 20
    assert one.losses == raw.losses
    assert_losses_close(two.losses, raw.losses, rtol=1e-5)


def test_train_with_an_unsupported_initial_model_exits_2(tmp_path):
    folder = tiny_llama(tmp_path / "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
                           "--job.dump_folder", str(tmp_path), "--checkpoint.initial_load_path", str(folder)],
                          capture_output=True, text=True, timeout=120)
    _one_line_exit2(proc, "hidden_act = 'gelu'", "llama")
    assert not (tmp_path / "debug").exists()


def test_saved_hf_dataset_without_datasets_is_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # the hf extra not installed: its import fails
    from tests.test_evaluate import load_script

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    capsys.readouterr()
    assert load_script("pretokenize").main([str(saved), "--tokenizer", "embedded", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "saved to disk" in err[0] and "pip install 'outlier_titan[hf]'" in err[0]
    assert not (tmp_path / "o").exists()


def test_saved_hf_dataset_gives_the_shards_of_the_same_jsonl(tmp_path):
    import datasets

    from outlier_titan.data.pretokenized import open_split, pretokenize
    from outlier_titan.data import build_tokenizer

    texts = [" ".join(["w%d" % j for j in range(i % 17, i % 17 + 30)]) for i in range(200)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    a = pretokenize(str(tmp_path / "c.jsonl"), "embedded", tmp_path / "a", workers=1, progress=False)
    b = pretokenize(str(tmp_path / "saved"), "embedded", tmp_path / "b", workers=1, progress=False)
    tok = build_tokenizer("embedded")
    for split in ("train", "validation"):
        assert a["splits"][split]["documents"] == b["splits"][split]["documents"]
        x, _ = open_split(tmp_path / "a", split, tok)
        y, _ = open_split(tmp_path / "b", split, tok)
        assert np.array_equal(x[0:len(x)], y[0:len(y)])
