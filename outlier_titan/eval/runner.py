"""Post-training evaluation of one model: full-precision PPL, PPL under each fake-quant scheme, probe metrics.

``scripts/evaluate.py`` loads a checkpoint and the data and calls :func:`evaluate_model`; this module only
needs a model and token batches, so it is tested without checkpoints.
"""

from __future__ import annotations

from typing import Callable, Sequence, TextIO

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from outlier_titan.config.job_config import Observe
from outlier_titan.eval.perplexity import perplexity
from outlier_titan.eval.report import scheme_entry
from outlier_titan.observe.metrics import evaluations
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.quant.ptq import SCHEMES, check_schemes, get_scheme, quantized


def evaluate_model(model: nn.Module, *, eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   probe_tokens: Sequence[torch.Tensor], calib_batches: Callable[[int], list[torch.Tensor]],
                   schemes: Sequence[str] | None = None, calib_seeds: Sequence[int] = (0, 1, 2),
                   device: torch.device | str = "cpu", stream: TextIO | None = None, probe: bool = True,
                   ) -> tuple[dict, dict[str, np.ndarray]]:
    """The report dict (see :mod:`outlier_titan.eval.report`) and the probe pictures; ``schemes``: registered
    scheme names (None: every registered one).

    ``calib_batches(seed)`` gives the calibration token batches of static and GPTQ schemes; each such scheme, and
    each rotated scheme (its random signs), is run once per seed in ``calib_seeds`` and reported as mean ± std
    (He et al. 2024's protocol uses 3 seeds). ``probe=False`` leaves out the probe metrics, the whole-model
    measures (``observe.metrics.evaluations()``: Park et al.'s kurtosis) and the pictures
    (``scripts/evaluate.py --update`` keeps the existing report's).
    """
    schemes = check_schemes(SCHEMES if schemes is None else schemes, "quantisation scheme(s)")
    model.eval()
    total = sum(labels.numel() for _, labels in eval_batches)
    runs = 1 + sum(len(calib_seeds) if get_scheme(name).seeded else 1 for name in schemes)
    # one bar over every perplexity pass (full precision, then each scheme and calibration seed)
    with tqdm(total=total * runs, desc="full precision", unit="tok", unit_scale=True, file=stream,
              dynamic_ncols=True) as bar:
        fp = perplexity(model, eval_batches, device, bar)
        observe = Observe(mode="full", kurtosis_centered=True, gradients=True)
        probe_scalars, images = OutlierProbe(model, observe).measure(
            [t.to(device) for t in probe_tokens]) if probe else ({}, {})
        entries = []
        for name in schemes:
            scheme = get_scheme(name)
            seeds = list(calib_seeds) if scheme.seeded else [None]
            ppls, head, weights, rotation, edits = [], "", {}, None, []
            for seed in seeds:
                calib = [t.to(device) for t in calib_batches(seed)] if scheme.calibrate else None
                bar.set_description(name if seed is None else
                                    f"{name} ({'calibration' if scheme.calibrate else 'rotation'} seed {seed})")
                with quantized(model, scheme, calib, weight_cache=weights, seed=seed or 0) as info:
                    ppls.append(perplexity(info["model"], eval_batches, device, bar).ppl)
                head, rotation = info["head"], info.get("rotation")
                if "edit" in info:
                    edits.append(info["edit"])
            entries.append(scheme_entry(name, scheme.description, head, ppls, fp.ppl))
            if rotation is not None:  # the same construction at every seed; the seeds are its random signs
                entries[-1]["rotation"] = {**rotation, "seeds": seeds}
            if edits:  # what a model-editing scheme changed, per seed (the super weights it zeroed)
                entries[-1]["edit"] = edits
    report = {
        "tokens": fp.tokens,
        "seq_len": int(eval_batches[0][0].shape[1]),
        "full_precision": {"ppl": fp.ppl, "loss": fp.loss},
        "schemes": entries,
    }
    if probe:
        report["probe"] = probe_scalars
        for e in evaluations():
            report[e.key] = e.measure(model, [t.to(device) for t in probe_tokens])
    return report, images
