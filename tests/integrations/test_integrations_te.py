"""Transformer Engine recipe objects: the pinned spec for every recipe (no TE needed), the NVTE_*
import-order rule, and — where TE's pure-Python recipe module can be found — the real TE
dataclasses built and verified from our specs.

TE's ``transformer_engine/common/recipe/__init__.py`` needs only pydantic, so it is loaded
stand-alone (without TE's CUDA libraries) from an installed TE or from the directory named by
``NEMO_FP8_TE_SRC`` (e.g. an unpacked ``transformer_engine-2.20.2-py3-none-any.whl``)."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from nemo_fp8_recipes import get_recipe, list_recipes, to_te_recipe
from nemo_fp8_recipes.integrations import te
from nemo_fp8_recipes.integrations.te import (
    ENV_BLOCK_FP32_SCALES,
    ENV_CURRENT_POW2_SCALES,
    TEImportOrderError,
    TEUnsupportedError,
    te_autocast,
    te_env,
    te_recipe_spec,
)

FP8 = [r for r in list_recipes() if r != "bf16"]


def _te_recipe_source():
    root = os.environ.get("NEMO_FP8_TE_SRC")
    if root:
        p = Path(root) / "transformer_engine" / "common" / "recipe" / "__init__.py"
        return p if p.is_file() else None
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "common" / "recipe" / "__init__.py"
    return p if p.is_file() else None


_TE_SRC = _te_recipe_source()
_HAVE_PYDANTIC = importlib.util.find_spec("pydantic") is not None
needs_te_source = pytest.mark.skipif(
    _TE_SRC is None or not _HAVE_PYDANTIC,
    reason="Transformer Engine's recipe module not found (TE not installed; set NEMO_FP8_TE_SRC to an unpacked "
    "transformer_engine wheel to check against it) or pydantic missing",
)


def load_te_recipe_module(env: dict, name: str):
    """Execute TE's recipe module stand-alone with ``env`` set, as a fresh TE import would."""
    saved = {k: os.environ.get(k) for k in (ENV_BLOCK_FP32_SCALES, ENV_CURRENT_POW2_SCALES)}
    try:
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        spec = importlib.util.spec_from_file_location(name, _TE_SRC)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # pydantic resolves annotations through the module
        spec.loader.exec_module(mod)
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("key", FP8)
def test_spec_pins_every_argument(key):
    spec = te_recipe_spec(key)
    assert (
        spec.te_class
        == {
            "delayed": "DelayedScaling",
            "tensorwise": "Float8CurrentScaling",
            "blockwise": "Float8BlockScaling",
            "mxfp8": "MXFP8BlockScaling",
        }[key]
    )
    assert spec.kwargs["fp8_dpa"] is False and spec.kwargs["fp8_mha"] is False  # attention core stays BF16
    assert spec.kwargs["backward_override"] is None
    if key == "delayed":
        assert spec.kwargs == {
            "margin": 0,
            "fp8_format": "HYBRID",
            "amax_history_len": 1024,
            "amax_compute_algo": "max",
            "scaling_factor_compute_algo": None,
            "reduce_amax": True,
            "fp8_dpa": False,
            "fp8_mha": False,
            "backward_override": None,
        }
        assert spec.env == {}
    if key == "tensorwise":
        assert spec.kwargs["fp8_format"] == "HYBRID" and spec.kwargs["use_power_2_scales"] is False
        # fast accumulation only for fprop (TE default), split accumulator for dgrad/wgrad
        assert [spec.kwargs[f"fp8_gemm_{g}"]["use_split_accumulator"] for g in ("fprop", "dgrad", "wgrad")] == [
            False,
            True,
            True,
        ]
        assert spec.env == {ENV_CURRENT_POW2_SCALES: "0"}
    if key == "blockwise":
        assert spec.kwargs["fp8_format"] == "E4M3"  # DeepSeek-V3: E4M3 everywhere
        assert (
            spec.kwargs["x_block_scaling_dim"],
            spec.kwargs["w_block_scaling_dim"],
            spec.kwargs["grad_block_scaling_dim"],
        ) == (1, 2, 1)
        assert spec.env == {ENV_BLOCK_FP32_SCALES: "0"}  # power-of-2 scales (TE default)
        assert spec.expected["fp8_quant_fwd_inp.power_2_scale"] is True
    if key == "mxfp8":
        assert spec.kwargs["fp8_format"] == "E4M3" and spec.kwargs["enable_2d_quantization"] is False


def test_env_follows_the_recipe_knobs():
    assert te_env(get_recipe("blockwise", scale_rounding="fp32")) == {ENV_BLOCK_FP32_SCALES: "1"}
    assert te_env(get_recipe("tensorwise", scale_rounding="pow2")) == {ENV_CURRENT_POW2_SCALES: "1"}
    assert te_env("bf16") == {} and te_env("delayed") == {}
    spec = te_recipe_spec(
        get_recipe("tensorwise", scale_rounding="pow2", grad_format="e4m3", fprop={"fast_accum": False})
    )
    assert spec.kwargs["fp8_format"] == "E4M3" and spec.kwargs["use_power_2_scales"] is True
    assert spec.kwargs["fp8_gemm_fprop"] == {"use_split_accumulator": True}
    assert "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1" in spec.describe()


@pytest.mark.parametrize(
    "recipe, match",
    [
        ("bf16", "no Transformer Engine recipe"),
        (lambda: get_recipe("blockwise", emulate=True), "native-backend option"),
        (lambda: get_recipe("delayed", fprop={"fast_accum": False}), "fixes GEMM accumulation"),
        (lambda: get_recipe("mxfp8", scale_rounding="e8m0_floor"), "round-up E8M0 rule"),
    ],
)
def test_what_te_cannot_express_is_refused_with_the_way_out(recipe, match):
    r = recipe() if callable(recipe) else recipe
    with pytest.raises(TEUnsupportedError, match=match):
        te_recipe_spec(r)


def test_to_te_recipe_without_te_says_how_to_get_it(monkeypatch):
    if te.te_available()[0]:
        pytest.skip("Transformer Engine is installed here")
    monkeypatch.delenv(ENV_BLOCK_FP32_SCALES, raising=False)
    with pytest.raises(ImportError, match="needs Transformer Engine .*backend=native"):
        to_te_recipe("blockwise")
    # the environment was prepared before the (failed) import, as it must be
    assert os.environ[ENV_BLOCK_FP32_SCALES] == "0"


def test_te_autocast_prefers_autocast_and_falls_back_to_fp8_autocast():
    calls = []
    new = types.SimpleNamespace(autocast=lambda **kw: calls.append(("autocast", kw)) or "ctx")
    old = types.SimpleNamespace(fp8_autocast=lambda **kw: calls.append(("fp8_autocast", kw)) or "ctx")
    te_recipe_obj = object()  # stands for a TE recipe instance
    te_autocast(te_recipe_obj, te_module=new, amax_reduction_group="g")
    te_autocast(te_recipe_obj, enabled=False, te_module=old)
    assert calls[0] == ("autocast", {"enabled": True, "recipe": te_recipe_obj, "amax_reduction_group": "g"})
    assert calls[1] == ("fp8_autocast", {"enabled": False, "fp8_recipe": te_recipe_obj, "fp8_group": None})
    te_autocast("bf16", te_module=new)  # bf16: no TE recipe, FP8 off
    assert calls[2] == ("autocast", {"enabled": False, "recipe": None, "amax_reduction_group": None})


@needs_te_source
@pytest.mark.parametrize("key", FP8)
def test_real_te_dataclasses_accept_and_show_our_spec(key):
    mod = load_te_recipe_module(te_env(key), f"_te_recipe_{key}")
    obj = to_te_recipe(key, te_recipe_module=mod)
    assert type(obj).__name__ == te_recipe_spec(key).te_class
    fields = {f.name for f in __import__("dataclasses").fields(type(obj))}
    spec = te_recipe_spec(key)
    pinned = set(spec.kwargs) - spec.optional
    assert pinned <= fields, pinned - fields  # every required argument exists in this TE
    # every constructor field TE has for this class is either pinned by us or not numeric
    unpinned = fields - set(spec.kwargs)
    assert unpinned <= {"fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"}, unpinned
    if key == "delayed":
        assert (obj.amax_history_len, obj.amax_compute_algo, obj.margin) == (1024, "max", 0)
        assert obj.fp8_format is mod.Format.HYBRID
    if key == "blockwise":
        assert obj.fp8_quant_fwd_inp.power_2_scale and obj.fp8_quant_bwd_grad.power_2_scale
        assert obj.fp8_format is mod.Format.E4M3 and obj.w_block_scaling_dim == 2
    if key == "tensorwise":
        assert not obj.fp8_gemm_fprop.use_split_accumulator and obj.fp8_gemm_wgrad.use_split_accumulator


@needs_te_source
def test_te_imported_with_the_other_setting_is_refused():
    fp32 = get_recipe("blockwise", scale_rounding="fp32")
    pow2_te = load_te_recipe_module({}, "_te_recipe_pow2")  # TE imported without the variable
    with pytest.raises(TEImportOrderError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 before"):
        to_te_recipe(fp32, te_recipe_module=pow2_te)
    fp32_te = load_te_recipe_module({ENV_BLOCK_FP32_SCALES: "1"}, "_te_recipe_fp32")
    obj = to_te_recipe(fp32, te_recipe_module=fp32_te)
    assert obj.fp8_quant_fwd_inp.power_2_scale is False
    # the constructor flag alone does not change the numbers (the import-order trap itself)
    flag_only = pow2_te.Float8BlockScaling(use_f32_scales=True)
    assert flag_only.fp8_quant_fwd_inp.power_2_scale is True
    pow2_cur = load_te_recipe_module({}, "_te_recipe_cur")
    with pytest.raises(TEImportOrderError, match="NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1"):
        to_te_recipe(get_recipe("tensorwise", scale_rounding="pow2"), te_recipe_module=pow2_cur)
