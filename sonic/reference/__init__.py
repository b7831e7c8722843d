"""PyTorch reference backend: the test oracle and the fallback for every kernel."""

from sonic.reference.ops import (aggregate, dswiglu_epilogue, grouped_mm, grouped_mm_varlen_k, swiglu)

__all__ = ["aggregate", "dswiglu_epilogue", "grouped_mm", "grouped_mm_varlen_k", "swiglu"]
