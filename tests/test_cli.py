"""Command-line surface: every script's --help shows its description and defaults; the tokenizer/source check."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_evaluate import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, argv, expected", [
    ("evaluate", ["--help"], ["Writes ``FILE``", "(default: 65536)", "(default: auto)"]),
    ("analyze", ["--help"], ["Panels:", "(default: kurtosis_first,"]),
    ("anatomy", ["--help"], ["Large = |x| above", "(default: 16384)"]),
    ("train_tokenizer", ["--help"], ["counts the EOS special token", "(default: 4096)"]),
    ("benchmark", ["optim", "--help"], ["(default: 256,64)", "(default: 5)"]),
])
def test_script_help_shows_description_and_defaults(script, argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(script).main(argv)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in expected:
        assert fragment in out, (script, fragment)


def test_dry_run_prints_the_tokenizer_and_warns_on_a_mismatched_one():
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"), "--dry_run",
           "--parallelism.dp_shard", "1", "--data.source", "fineweb"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokenizer         embedded (stdlib_bpe), vocabulary 4,096 | data.source fineweb" in proc.stdout
    assert "warning: data.tokenizer 'embedded' is a 4,096-token BPE trained on Python source" in proc.stdout
    assert "set data.tokenizer to 'tiktoken:gpt2'" in proc.stdout


def test_large_configs_name_a_real_tokenizer():
    import tomllib

    from outlier_titan.data.sources import tokenizer_mismatch

    for path in sorted((REPO / "train_configs").glob("*.toml")):
        data = tomllib.loads(path.read_text()).get("data", {})
        assert tokenizer_mismatch(data.get("source", "embedded"), data.get("tokenizer", "embedded")) is None, path


def test_probe_batch_is_global_and_must_split_over_the_dp_ranks():
    from outlier_titan.config.manager import ConfigError, parse_args
    from outlier_titan.training.step import probe_layout

    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--observe.every", "10",
                      "--observe.batch_size", "6"])
    assert probe_layout(cfg, 1) == 6 and probe_layout(cfg, 2) == 3 and probe_layout(cfg, 3) == 2
    with pytest.raises(ConfigError, match=r"observe.batch_size = 6 \(the global probe batch\) is not a positive "
                                          r"multiple of the data-parallel degree 4; set it to a multiple of 4"):
        probe_layout(cfg, 4)
    cfg.observe.every = 0  # no probe: nothing to check
    probe_layout(cfg, 4)

