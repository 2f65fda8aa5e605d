"""Compile the Triton quantisers for real GPUs without a GPU (Triton's bundled ptxas) and report,
as one JSON line, whether each variant compiles and which FP8 conversion instructions its PTX
uses: the library's kernels and the benchmarks' one-read 1xN pair kernel
(benchmarks/fp8_kernels/quantize_dual.py). Run by tests/quant/test_triton_kernels.py in a subprocess without
TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its one-read pair kernel


def main() -> None:
    spec = importlib.util.find_spec("triton.backends.nvidia")
    if spec is None or not any((Path(spec.origin).parent / "bin").glob("ptxas*")):
        print(json.dumps({"skip": "this Triton has no NVIDIA backend / ptxas to compile for a GPU"}))
        return
    import triton
    from fp8_kernels.quantize_dual import _quant_dual_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nemo_fp8_recipes.formats import Format
    from nemo_fp8_recipes.quant import triton_kernels as tk

    out = {}

    def comp(name, fn, sig, consts, cc=90):
        try:
            ptx = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", cc, 32)
            ).asm["ptx"]
            out[name] = {
                "error": None,
                "direct_f32_cvt": any(f"cvt.rn.satfinite.{f}x2.f32" in ptx for f in ("e4m3", "e5m2")),
                "via_f16_cvt": any(f"{f}x2.f16x2" in ptx for f in ("e4m3", "e5m2")),
            }
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}

    def cast_sig(e4):
        return {
            "x_ptr": "*bf16",
            "amax_ptr": "*fp32",
            "s_ptr": "*fp32",
            "si_ptr": "*fp32",
            "q_ptr": "*fp8e4nv" if e4 else "*fp8e5",
            "N": "i32",
            "BLOCK": "constexpr",
            "FMAX": "constexpr",
            "IS_E4M3": "constexpr",
            "HW_CVT": "constexpr",
            "HAS_SCALE": "constexpr",
            "MODE": "constexpr",
            "AMAX_OUT": "constexpr",
            "AMAX_CHECK": "constexpr",
        }

    for fmt, e4 in (("e4m3", True), ("e5m2", False)):
        consts = {
            "BLOCK": 1024,
            "FMAX": Format(fmt).max,
            "IS_E4M3": e4,
            "HW_CVT": True,
            "HAS_SCALE": True,
            "MODE": 0,
            "AMAX_OUT": False,
            "AMAX_CHECK": False,
        }
        for cc in (89, 90):
            comp(f"cast_{fmt}_sm{cc}", tk.tensor.cast_kernel, cast_sig(e4), consts, cc)

    rows_sig = {
        "x_ptr": "*bf16",
        "q_ptr": "*fp8e4nv",
        "si_ptr": "*fp32",
        "e8_ptr": "*u8",
        "R": "i32",
        "C": "i32",
        "G": "i32",
        "stride_x": "i32",
        "n_r": "i32",
        "n_c": "i32",
        "group_r": "i32",
        "GROUP": "constexpr",
        "NG": "constexpr",
        "BLOCK_R": "constexpr",
        "MODE": "constexpr",
        "FMAX": "constexpr",
        "EMAX": "constexpr",
        "TOP_MANT": "constexpr",
        "IS_E4M3": "constexpr",
        "HW_CVT": "constexpr",
    }
    cols_sig = {**{("BLOCK_C" if k == "BLOCK_R" else k): v for k, v in rows_sig.items()}, "BF16_TILE": "constexpr"}
    common = {"FMAX": 448.0, "EMAX": 8, "TOP_MANT": tk.common.top_mant(Format.E4M3), "IS_E4M3": True}
    for hw in (True, False):
        for group, mode in ((128, 1), (32, 2)):
            for ng in (1, 4):
                comp(
                    f"kernel_rows{group}_ng{ng}_hw{int(hw)}",
                    tk.groups.quant_rows_kernel,
                    rows_sig,
                    {**common, "HW_CVT": hw, "GROUP": group, "NG": ng, "BLOCK_R": 64 // ng, "MODE": mode},
                )
                for bf16 in (False, True):  # the tile in FP32, or (BF16 sources) in BF16 through the amax
                    comp(
                        f"kernel_cols{group}_ng{ng}_bf16{int(bf16)}_hw{int(hw)}",
                        tk.groups.quant_cols_t_kernel,
                        cols_sig,
                        {
                            **common,
                            "HW_CVT": hw,
                            "GROUP": group,
                            "NG": ng,
                            "BLOCK_C": 64,
                            "MODE": mode,
                            "BF16_TILE": bf16,
                        },
                    )
    dual_sig = {
        "x_ptr": "*bf16",
        "q_ptr": "*fp8e4nv",
        "si_ptr": "*fp32",
        "e8_ptr": "*u8",
        "qt_ptr": "*fp8e4nv",
        "sit_ptr": "*fp32",
        "e8t_ptr": "*u8",
        "R": "i32",
        "C": "i32",
        "G_row": "i32",
        "G_col": "i32",
        "stride_x": "i32",
        "n_r": "i32",
        "n_c": "i32",
        "group_r": "i32",
        "GROUP": "constexpr",
        "TILE": "constexpr",
        "MODE": "constexpr",
        "FMAX": "constexpr",
        "EMAX": "constexpr",
        "TOP_MANT": "constexpr",
        "IS_E4M3": "constexpr",
        "HW_CVT": "constexpr",
    }
    comp("kernel_dual32", _quant_dual_kernel, dual_sig, {**common, "HW_CVT": True, "GROUP": 32, "TILE": 64, "MODE": 2})
    comp(
        "kernel_dual128", _quant_dual_kernel, dual_sig, {**common, "HW_CVT": True, "GROUP": 128, "TILE": 128, "MODE": 1}
    )
    comp(
        "kernel_delayed_commit",
        tk.tensor.delayed_commit_kernel,
        {
            "hist_ptr": "*fp32",
            "scale_ptr": "*fp32",
            "pending_ptr": "*fp32",
            "flag_ptr": "*fp32",
            "L": "i32",
            "flag_after": "fp32",
            "BLOCK_L": "constexpr",
            "FMAX": "constexpr",
            "MARGIN_DIV": "constexpr",
            "MOST_RECENT": "constexpr",
        },
        {"BLOCK_L": 1024, "FMAX": 448.0, "MARGIN_DIV": 2.0, "MOST_RECENT": False},
    )
    block_sig = {
        "x_ptr": "*fp32",
        "q_ptr": "*fp8e4nv",
        "qt_ptr": "*fp8e4nv",
        "si_ptr": "*fp32",
        "R": "i32",
        "C": "i32",
        "GC": "i32",
        "stride_x": "i32",
        "n_r": "i32",
        "n_c": "i32",
        "group_r": "i32",
        "BLOCK": "constexpr",
        "MODE": "constexpr",
        "FMAX": "constexpr",
        "IS_E4M3": "constexpr",
        "HW_CVT": "constexpr",
        "TRANS": "constexpr",
    }
    for trans in (False, True):
        comp(
            f"kernel_blocks128_trans{int(trans)}",
            tk.blocks.quant_block_kernel,
            block_sig,
            {"BLOCK": 128, "MODE": 1, "FMAX": 448.0, "IS_E4M3": True, "HW_CVT": True, "TRANS": trans},
        )
    gate_sig = {"GATED": "constexpr", "LIBDEVICE": "constexpr", "IN_BF16": "constexpr"}
    for gated, write, check in (
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (False, False, True),
        (True, False, True),
        (True, True, True),
    ):
        comp(
            f"kernel_amax_atomic_gated{int(gated)}_write{int(write)}_check{int(check)}",
            tk.tensor.amax_atomic_kernel,
            {
                "x_ptr": "*bf16",
                "g_ptr": "*bf16",
                "amax_bits_ptr": "*i32",
                "act_ptr": "*bf16",
                "N": "i32",
                "BLOCK": "constexpr",
                **gate_sig,
                "WRITE_ACT": "constexpr",
                "AMAX_CHECK": "constexpr",
            },
            {
                "BLOCK": 8192,
                "GATED": gated,
                "LIBDEVICE": True,
                "IN_BF16": True,
                "WRITE_ACT": write,
                "AMAX_CHECK": check,
            },
        )
    comp(
        "kernel_swiglu_bwd",
        tk.swiglu.swiglu_bwd_kernel,
        {
            "dy_ptr": "*bf16",
            "g_ptr": "*bf16",
            "u_ptr": "*bf16",
            "dg_ptr": "*bf16",
            "du_ptr": "*bf16",
            "N": "i32",
            "BLOCK": "constexpr",
            "LIBDEVICE": "constexpr",
            "IN_BF16": "constexpr",
        },
        {"BLOCK": 4096, "LIBDEVICE": True, "IN_BF16": True},
    )
    for fmt, e4 in (("e4m3", True), ("e5m2", False)):
        # current scaling (amax read), and a given scale with the amax folded in (int32 atomics)
        for has_scale in (True, False):
            sig = {**cast_sig(e4), "amax_ptr": "*i32" if has_scale else "*fp32"}
            comp(
                f"kernel_cast_{fmt}_scale{int(has_scale)}",
                tk.tensor.cast_kernel,
                sig,
                {
                    "BLOCK": 8192,
                    "FMAX": Format(fmt).max,
                    "IS_E4M3": e4,
                    "HW_CVT": True,
                    "HAS_SCALE": has_scale,
                    "MODE": 0,
                    "AMAX_OUT": has_scale,
                    "AMAX_CHECK": has_scale,
                },
            )
            dual = {
                "x_ptr": "*bf16",
                "g_ptr": "*bf16",
                "amax_ptr": "*i32" if has_scale else "*fp32",
                "s_ptr": "*fp32",
                "si_ptr": "*fp32",
                "q_ptr": "*fp8e4nv" if e4 else "*fp8e5",
                "qt_ptr": "*fp8e4nv" if e4 else "*fp8e5",
                "R": "i32",
                "C": "i32",
                "stride_x": "i32",
                "BLOCK_R": "constexpr",
                "BLOCK_C": "constexpr",
                "FMAX": "constexpr",
                "IS_E4M3": "constexpr",
                "HW_CVT": "constexpr",
                "HAS_SCALE": "constexpr",
                "MODE": "constexpr",
                "AMAX_OUT": "constexpr",
                "BF16_TILE": "constexpr",
                **gate_sig,
                "AMAX_CHECK": "constexpr",
            }
            comp(
                f"kernel_cast_dual_{fmt}_scale{int(has_scale)}",
                tk.tensor.cast_dual_kernel,
                dual,
                {
                    "BLOCK_R": 128,
                    "BLOCK_C": 64,
                    "FMAX": Format(fmt).max,
                    "IS_E4M3": e4,
                    "HW_CVT": True,
                    "HAS_SCALE": has_scale,
                    "MODE": 1,
                    "AMAX_OUT": has_scale,
                    "GATED": has_scale,
                    "LIBDEVICE": True,
                    "IN_BF16": True,
                    "BF16_TILE": False,
                    "AMAX_CHECK": has_scale,
                },
            )
        # the delayed pair with the amax taken on the BF16 tile as loaded (bf16_tile)
        comp(
            f"kernel_cast_dual_{fmt}_bf16_tile",
            tk.tensor.cast_dual_kernel,
            {**dual, "amax_ptr": "*i32"},
            {
                "BLOCK_R": 32,
                "BLOCK_C": 256,
                "FMAX": Format(fmt).max,
                "IS_E4M3": e4,
                "HW_CVT": True,
                "HAS_SCALE": True,
                "MODE": 1,
                "AMAX_OUT": True,
                "GATED": False,
                "LIBDEVICE": True,
                "IN_BF16": True,
                "BF16_TILE": True,
                "AMAX_CHECK": True,
            },
        )
    norm_sig = {
        "x_ptr": "*bf16",
        "w_ptr": "*fp32",
        "y_ptr": "*bf16",
        "rstd_ptr": "*fp32",
        "amax_ptr": "*i32",
        "q_ptr": "*fp8e4nv",
        "si_ptr": "*fp32",
        "e8_ptr": "*u8",
        "R": "i32",
        "D": "i32",
        "G": "i32",
        "stride_x": "i32",
        "stride_y": "i32",
        "inv_d": "fp32",
        "eps": "fp32",
        "BLOCK_D": "constexpr",
        "OUT_BF16": "constexpr",
        "AMAX": "constexpr",
        "GROUP": "constexpr",
        "MODE": "constexpr",
        "FMAX": "constexpr",
        "EMAX": "constexpr",
        "TOP_MANT": "constexpr",
        "IS_E4M3": "constexpr",
        "HW_CVT": "constexpr",
    }
    for amax, group, mode in ((False, 0, 0), (True, 0, 0), (False, 128, 1), (False, 32, 2)):
        comp(
            f"kernel_rmsnorm_fwd_amax{int(amax)}_rows{group}",
            tk.norm.rmsnorm_fwd_kernel,
            norm_sig,
            {**common, "HW_CVT": True, "BLOCK_D": 4096, "OUT_BF16": True, "AMAX": amax, "GROUP": group, "MODE": mode},
        )
    comp(
        "kernel_rmsnorm_bwd",
        tk.norm.rmsnorm_bwd_kernel,
        {
            "dy_ptr": "*bf16",
            "x_ptr": "*bf16",
            "w_ptr": "*fp32",
            "rstd_ptr": "*fp32",
            "dx_ptr": "*bf16",
            "dw_ptr": "*fp32",
            "R": "i32",
            "D": "i32",
            "stride_dy": "i32",
            "stride_x": "i32",
            "inv_d": "fp32",
            "ROWS": "constexpr",
            "BLOCK_D": "constexpr",
            "HAS_DW": "constexpr",
            "OUT_BF16": "constexpr",
        },
        {"ROWS": 16, "BLOCK_D": 16384, "HAS_DW": True, "OUT_BF16": True},
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
