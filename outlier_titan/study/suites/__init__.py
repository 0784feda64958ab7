"""The reproduction suites, one module per paper: each holds the paper's numbers, its claims and the thresholds they
use, and any report part of its own, as a :class:`~outlier_titan.study.suites.base.Suite` named ``SUITE``. A
suite's sweep files are ``train_configs/suites/<name>/<scale>.toml``; a new suite is one module here, one line in
:data:`SUITES` and its sweep files."""

from __future__ import annotations

from outlier_titan.study.suites import (franke2025, he2024, kaul2024, lowprec2026, park2025, sinks2025,
                                       sinks_vs_massive2026)
from outlier_titan.study.suites.base import Suite, SuiteInfo

SUITES: dict[str, Suite] = {"kaul2024": kaul2024.SUITE, "he2024": he2024.SUITE, "franke2025": franke2025.SUITE,
                            "sinks2025": sinks2025.SUITE, "park2025": park2025.SUITE,
                            "sinks_vs_massive2026": sinks_vs_massive2026.SUITE, "lowprec2026": lowprec2026.SUITE}
SUITE_NAMES = tuple(SUITES)
SUITE_INFO: dict[str, SuiteInfo] = {name: suite.info for name, suite in SUITES.items()}
