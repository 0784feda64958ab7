"""Hugging Face interop in one place, layered one way (each module uses only those above it, and config, models,
data and the DCP checkpoint reader; never the trainer):

- :mod:`~outlier_titan.hf.folders`: HF folders (``config.json``, safetensors, sharded or not), our export
  (``model.safetensors`` + ``config.toml``) and their tokenizer files, read and written;
- :mod:`~outlier_titan.hf.adapters`: GPT-2 / Llama state-dict adapters and the ``[model]`` section of an HF config;
- :mod:`~outlier_titan.hf.load`: any stored model at world size 1, and the start-up import of
  ``checkpoint.initial_load_path`` that the trainer calls;
- :mod:`~outlier_titan.hf.export`: a stored model written as an HF folder or our export.
"""
