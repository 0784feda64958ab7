"""outlier_titan: a torch-native distributed LLM pretraining stack for studying outlier features."""

__version__ = "0.1.0"
