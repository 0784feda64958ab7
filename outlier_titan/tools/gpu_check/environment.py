"""The environment report: versions, the GPU(s) and nvidia-smi, and which of the package's modules fail to import."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path

from outlier_titan.provenance import git_commit


REPO = Path(__file__).resolve().parents[3]


def environment() -> dict:
    """Versions, the GPU(s) and nvidia-smi, and which of the package's modules fail to import."""
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "hostname": platform.node(),
           "cpus": os.cpu_count(), "commit": git_commit()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                           "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                          for i in range(torch.cuda.device_count())]
        env["cudnn"] = torch.backends.cudnn.version()
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
        env["flash_sdp_enabled"] = torch.backends.cuda.flash_sdp_enabled()
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["nvidia_smi"] = f"not available ({type(e).__name__})"
    env["required_torch"] = _required_torch()
    env["torch_meets_requirement"] = _meets(torch.__version__, env["required_torch"])
    env["missing_modules"] = _missing_dependencies()
    env["import_failures"] = _import_failures()
    return env


def _required_torch() -> str | None:
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        return None
    from outlier_titan.config.manager import tomllib  # tomli before Python 3.11

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return next((d for d in deps if d.replace(" ", "").startswith("torch>") or d.startswith("torch=")), None)


def _meets(version: str, requirement: str | None) -> bool | None:
    """Whether ``version`` satisfies a ``torch>=X.Y`` requirement (None when there is none to check)."""
    import re

    m = re.fullmatch(r"torch>=([0-9.]+)", (requirement or "").replace(" ", ""))
    if not m:
        return None
    have = tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])
    want = tuple(int(x) for x in m.group(1).split("."))
    return have[:len(want)] >= want


# import name of each runtime dependency in pyproject
DEPENDENCY_MODULES = ("torch", "torchdata", "tiktoken", "tensorboard", "numpy", "safetensors", "tqdm", "matplotlib")


def _missing_dependencies() -> list[str]:
    missing = []
    for name in DEPENDENCY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _import_failures() -> dict[str, str]:
    """module -> error for every ``outlier_titan`` module that does not import (an older torch, a missing
    wheel)."""
    failures = {}
    for path in sorted((REPO / "outlier_titan").rglob("*.py")):
        mod = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if mod.endswith("__init__") or mod.startswith("outlier_titan.tools.gpu_check"):
            continue
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - the report lists whatever breaks
            failures[mod] = f"{type(e).__name__}: {e}"[:300]
    return failures

