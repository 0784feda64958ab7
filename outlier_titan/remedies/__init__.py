"""Training-time remedies: loss terms and after-step hooks registered in :mod:`outlier_titan.remedies.registry`
(docs/extending.md, "A training remedy"). Importing the package registers the built-ins."""

from outlier_titan.remedies import qk_clip, tweo  # noqa: F401
from outlier_titan.remedies.registry import (Remedies, RemedyContext, RemedyHooks, register_remedy,  # noqa: F401
                                             remedies, validate_remedies)
