"""Command-line tools, each ``python -m outlier_titan.tools.<name>`` and the console script
``outlier-titan-<name>`` (``_`` as ``-``); the repository's ``scripts/<name>.py`` call the same ``main``."""
