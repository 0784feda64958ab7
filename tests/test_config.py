import subprocess
import sys

import pytest

from outlier_titan.config.manager import ConfigError, help_text, parse_args, to_toml
from outlier_titan.config.manager import tomllib
from outlier_titan.optim import builder  # noqa: F401  the built-in optimizers register, as in the trainer
from tests.launch import REPO

DEBUG = str(REPO / "train_configs" / "debug.toml")


def test_toml_then_cli_precedence():
    cfg = parse_args(["--config", DEBUG, "--training.steps", "7", "--optimizer.lr=0.5", "--model.softmax", "softmax1"])
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 0.5 and cfg.model.softmax == "softmax1"
    assert cfg.training.seq_len == 256  # from the TOML file
    assert cfg.metrics.tensorboard is True  # dataclass default


def test_type_conversion_of_cli_values():
    cfg = parse_args(["--config", DEBUG, "--checkpoint.enable", "false", "--optimizer.no_decay", "norm,bias",
                      "--model.bias", "true", "--training.micro_batch_size", "none"])
    assert cfg.checkpoint.enable is False and cfg.optimizer.no_decay == ["norm", "bias"]
    assert cfg.model.bias is True and cfg.training.micro_batch_size is None


@pytest.mark.parametrize("argv, fragment", [
    (["--training.stpes", "3"], "did you mean 'training.steps'"),
    (["--trainig.steps", "3"], "did you mean 'training.steps'"),
    (["--training.tokenizer", "x"], "did you mean 'data.tokenizer'"),
    (["--training.steps", "three"], "training.steps: expected int"),
    (["--optimizer.name", "lion"], "choose one of"),
    (["--training.global_batch_size", "0"], "training.global_batch_size must be > 0"),
    (["--optimizer.beta2", "1.0"], "optimizer.beta2 must be in [0, 1)"),
    (["--parallelism.dp_shard", "0"], "parallelism.dp_shard"),
    (["--lr_scheduler.min_lr_ratio", "2"], "lr_scheduler.min_lr_ratio must be in [0, 1]"),
    (["--training.steps"], "needs a value"),
    (["--optimizer.lr", "1e39"], "optimizer.lr = 1e+39 is not representable in float32"),
    (["--optimizer.lr", "1e-50"], "optimizer.lr = 1e-50 is not representable in float32"),
    (["--optimizer.lr", "inf"], "optimizer.lr must be a finite number"),
    (["--optimizer.lr", "nan"], "optimizer.lr must be a finite number"),
    (["--optimizer.lr", "0"], "optimizer.lr must be > 0"),
    (["--training.max_norm", "-inf"], "training.max_norm must be a finite number"),
    (["--training.max_skipped_steps", "-1"], "training.max_skipped_steps must be >= 0"),
])
def test_bad_values_are_one_line_errors(argv, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", DEBUG, *argv])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_wrong_type_in_toml(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps: expected int"):
        parse_args(["--config", str(f)])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        parse_args(["--config", "/nonexistent/x.toml"])


def test_help_lists_every_key_with_default():
    text = help_text()
    for key in ("--job.name", "--training.steps", "--optimizer.lr", "--parallelism.dp_shard",
                "--checkpoint.keep_latest_k", "--metrics.log_every", "--data.source", "--data.tokenizer"):
        assert key in text
    assert "default 'adamw'" in text


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = parse_args(["--config", DEBUG, "--training.steps", "9", "--model.norm", "rmsnorm_single"])
    f = tmp_path / "config.toml"
    f.write_text(to_toml(cfg))
    assert tomllib.loads(f.read_text())["training"]["steps"] == 9
    again = parse_args(["--config", str(f)])
    assert again == cfg


@pytest.mark.parametrize("argv, fragment", [
    (["--config", "/nope.toml"], "config file not found"),
    (["--config", DEBUG, "--training.bogus", "1"], "unknown key 'training.bogus'"),
    (["--config", DEBUG, "--training.steps", "x"], "expected int"),
    (["--config", DEBUG, "--optimizer.lr", "1e39"], "not representable in float32"),
])
def test_train_py_exits_2_with_one_line(argv, fragment):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_composed_section_names_owners_and_rejects_conflicting_declarations():
    import dataclasses

    import pytest

    from outlier_titan.options import OptionGroup, compose_section, opt, owned_by

    @dataclasses.dataclass
    class Common:
        lr: float = opt(1e-3, "Learning rate.")

    @dataclasses.dataclass
    class A:
        a_k: int = opt(2, "a: k.")
        shared: str = opt("x", "a and b: s.", ("x", "y"))

    @dataclasses.dataclass
    class B:
        shared: str = opt("y", "a and b: s.", ("x", "y"))

    ga, gb = OptionGroup("toy", "toy part", "a", A), OptionGroup("toy", "toy part", "b", B)
    sec = compose_section("Toy", Common, [ga, gb], optional=True, module=__name__)
    fields = {f.name: f for f in dataclasses.fields(sec)}
    assert list(fields) == ["lr", "a_k", "shared"] and sec().a_k is None and sec(a_k=3).a_k == 3
    assert owned_by(fields["lr"]) is None and owned_by(fields["shared"]) == ("toy part", "a, b")
    assert fields["shared"].metadata["defaults"] == {"a": "x", "b": "y"}
    with pytest.raises(TypeError, match="declared differently"):  # real defaults must agree
        compose_section("Toy", Common, [ga, gb], optional=False, module=__name__)
    sec = compose_section("Toy", Common, [ga], optional=False, module=__name__)
    assert sec().a_k == 2 and sec().shared == "x"
    with pytest.raises(TypeError, match="common option"):
        compose_section("Toy", Common, [OptionGroup("toy", "toy part", "c", Common)], optional=True, module=__name__)
