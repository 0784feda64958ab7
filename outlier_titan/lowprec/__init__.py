"""Low-precision training: the number formats and their casts (``formats``), the recipes that say which GEMM
operand is cast how (``recipes``), the model conversion behind ``[low_precision]`` (``training``); the probe's
view of the casts lives in ``outlier_titan.observe.lowprec``."""
