"""Integrations of sonic with other libraries.

:mod:`sonic.integrations.huggingface`: sonic as an experts implementation of Hugging Face
transformers (≥ 5) MoE models. Import it explicitly; it needs the ``hf`` extra
(``pip install "sonic-cute-moe[hf]"``), so this package imports nothing by itself.
"""
