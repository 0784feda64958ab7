"""The benchmarks behind ``outlier-titan-benchmark`` (``outlier_titan/tools/benchmark.py``), one module per family."""
