"""Triton kernels that the benchmarks time beside the library's, kept out of the library because
it does not use them (each module says why); they are built from the library's device functions
(:mod:`nemo_fp8_recipes.quant.triton_kernels.primitives`) and give the same codes."""
