"""Command-line tools, each ``python -m outlier_titan.tools.<name>`` and the console script
``outlier-titan-<name>`` (``_`` as ``-``); the repository's ``scripts/<name>.py`` call the same ``main``."""

from outlier_titan import components  # noqa: E402,F401  (every tool reads configs: the built-ins registered first)
