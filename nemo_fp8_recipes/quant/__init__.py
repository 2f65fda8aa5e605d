"""Quantisation core: reference quantisers (the contract) and scaled-GEMM dispatch."""

from .gemm import emulated_matmul, real_matmul, scaled_matmul
from .reference import (
    QuantizedTensor,
    amax_to_scale,
    cast_to_fp8,
    dequantize,
    e8m0_exponent,
    fake_quantize,
    quantization_stats,
    quantize,
    quantize_blocks,
    quantize_tensorwise,
    summarize_stats,
)

__all__ = [
    "QuantizedTensor",
    "amax_to_scale",
    "cast_to_fp8",
    "dequantize",
    "e8m0_exponent",
    "emulated_matmul",
    "fake_quantize",
    "quantization_stats",
    "quantize",
    "quantize_blocks",
    "quantize_tensorwise",
    "real_matmul",
    "scaled_matmul",
    "summarize_stats",
]
