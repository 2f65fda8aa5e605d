"""Recipe registry and hardware check (docs/recipes.md)."""

import dataclasses
import subprocess
import sys

import pytest

from nemo_fp8_recipes.formats import Format, Granularity, ScaleRounding
from nemo_fp8_recipes.hardware import DeviceInfo
from nemo_fp8_recipes.recipes import (
    ScalingKind,
    UnsupportedRecipeError,
    check_supported,
    get_recipe,
    list_recipes,
    require_supported,
)

CPU = DeviceInfo("cpu")
ADA = DeviceInfo("cuda", "NVIDIA L40S", (8, 9), (12, 8))
H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), (13, 0))
H100_OLD_CUDA = DeviceInfo("cuda", "NVIDIA H100", (9, 0), (12, 4))
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0), (12, 9))
GB300 = DeviceInfo("cuda", "NVIDIA GB300", (10, 3), (13, 0))
RTX5090 = DeviceInfo("cuda", "NVIDIA GeForce RTX 5090", (12, 0), (12, 9))
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0), (12, 4))


def test_registry_keys_and_order():
    assert list_recipes() == ["bf16", "delayed", "tensorwise", "blockwise", "mxfp8"]


@pytest.mark.parametrize("name", ["bf16", "delayed", "tensorwise", "blockwise", "mxfp8"])
def test_recipes_are_frozen_and_named(name):
    r = get_recipe(name)
    assert r.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.emulate = True
    assert get_recipe(name.upper()).name == name


def test_contract_fields():
    d = get_recipe("delayed")
    assert (d.input_format, d.weight_format, d.grad_format) == (Format.E4M3, Format.E4M3, Format.E5M2)
    assert (d.amax_history_len, d.amax_compute_algo, d.margin) == (1024, "max", 0)
    assert d.fprop.fast_accum and not d.dgrad.fast_accum and not d.wgrad.fast_accum
    t = get_recipe("tensorwise")
    assert t.is_hybrid and t.scale_rounding is ScaleRounding.FP32
    b = get_recipe("blockwise")
    assert b.grad_format is Format.E4M3 and b.scale_rounding is ScaleRounding.POW2
    assert (b.input_granularity, b.weight_granularity, b.grad_granularity) == (
        Granularity.TILE_1x128,
        Granularity.BLOCK_128x128,
        Granularity.TILE_1x128,
    )
    assert not any(getattr(b, g).fast_accum for g in ("fprop", "dgrad", "wgrad"))
    m = get_recipe("mxfp8")
    assert m.input_granularity is Granularity.BLOCK_1x32 and m.scale_rounding is ScaleRounding.E8M0_CEIL
    assert m.gemm_alignment == 32 and b.gemm_alignment == 128 and t.gemm_alignment == 16
    assert not get_recipe("bf16").is_fp8


def test_each_recipe_class_has_its_own_scaling_kind():
    """Callers ask ``recipe.scaling_kind`` (a class constant, not a field: overrides cannot change it)
    instead of comparing the recipe's name; every class has its own, delayed is the only delayed one."""
    kinds = {name: get_recipe(name).scaling_kind for name in list_recipes()}
    assert kinds == {
        "bf16": ScalingKind.NONE,
        "delayed": ScalingKind.DELAYED,
        "tensorwise": ScalingKind.CURRENT,
        "blockwise": ScalingKind.BLOCKWISE,
        "mxfp8": ScalingKind.MICROSCALING,
    }
    assert all(get_recipe(n).is_delayed == (k is ScalingKind.DELAYED) for n, k in kinds.items())
    assert "scaling_kind" not in get_recipe("blockwise").describe()
    assert get_recipe("blockwise", weight_granularity="1x128").scaling_kind is ScalingKind.BLOCKWISE


def test_overrides_and_string_enums():
    r = get_recipe("delayed", amax_history_len=16, amax_compute_algo="most_recent", margin=2)
    assert (r.amax_history_len, r.amax_compute_algo, r.margin) == (16, "most_recent", 2)
    assert get_recipe("blockwise", scale_rounding="fp32").scale_rounding is ScaleRounding.FP32
    assert get_recipe("mxfp8", scale_rounding="e8m0_floor").scale_rounding is ScaleRounding.E8M0_FLOOR
    assert get_recipe("tensorwise", fprop={"fast_accum": False}).fprop.fast_accum is False
    assert get_recipe("tensorwise", emulate=None).emulate is None
    assert r.replace(margin=0).margin == 0


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        (("fp4",), {}, "valid recipes: bf16, delayed, tensorwise, blockwise, mxfp8"),
        (("delayed",), {"amax_compute_algo": "mean"}, "choose one of: max, most_recent"),
        (("delayed",), {"amax_history_len": 0}, "amax_history_len must be an integer in 1..65536"),
        (("delayed",), {"margin": -1}, "margin must be an integer in 0..8"),
        (("delayed",), {"foo": 1}, "valid options:"),
        (("blockwise",), {"scale_rounding": "e8m0_ceil"}, "pow2 or fp32"),
        (("blockwise",), {"scale_rounding": "banana"}, "choose one of: fp32, pow2, e8m0_ceil, e8m0_floor"),
        (("mxfp8",), {"grad_format": "e5m2"}, "grad_format must be e4m3"),
        (("blockwise",), {"fprop": {"fast_accum": True}}, "fast_accum must be false"),
        (("tensorwise",), {"input_granularity": "1x128"}, "must be 'tensor'"),
        (("tensorwise",), {"emulate": "yes"}, "emulate must be true, false or null"),
        (("tensorwise",), {"dgrad": {"fast_acum": True}}, "unknown option(s) fast_acum; valid: fast_accum"),
    ],
)
def test_bad_values_list_the_valid_ones(args, kwargs, needle):
    with pytest.raises(ValueError, match=None) as e:
        get_recipe(*args, **kwargs)
    assert needle in str(e.value)


# (recipe, device, expected ok) — the hardware table of docs/recipes.md
MATRIX = [
    ("bf16", CPU, True),
    ("delayed", CPU, True),
    ("tensorwise", CPU, True),
    ("blockwise", CPU, True),
    ("mxfp8", CPU, True),
    ("delayed", ADA, True),
    ("tensorwise", ADA, True),
    ("blockwise", ADA, False),
    ("mxfp8", ADA, False),
    ("delayed", H200, True),
    ("tensorwise", H200, True),
    ("blockwise", H200, True),
    ("mxfp8", H200, False),
    ("blockwise", H100_OLD_CUDA, False),
    ("delayed", B200, True),
    ("tensorwise", B200, True),
    ("blockwise", B200, False),
    ("mxfp8", B200, True),
    ("mxfp8", GB300, True),
    ("tensorwise", RTX5090, True),
    ("mxfp8", RTX5090, False),
    ("blockwise", RTX5090, False),
    ("tensorwise", A100, False),
    ("bf16", A100, True),
]


@pytest.mark.parametrize("name, dev, ok", MATRIX, ids=[f"{n}-{d}" for n, d, _ in MATRIX])
def test_hardware_matrix(name, dev, ok):
    got, reason = check_supported(name, dev)
    assert got is ok, reason
    if not ok:
        # the reason names the recipe, the device found and a way out
        assert name in reason and str(dev) in reason
        assert "use " in reason or "upgrade" in reason
        # emulate=true always makes it runnable (numerics only)
        assert check_supported(get_recipe(name, emulate=True), dev)[0]


def test_error_messages_name_gpu_and_alternative():
    _, r = check_supported("mxfp8", H200)
    assert r == (
        "mxfp8 needs SM100 (Blackwell: B200/GB200); found SM90 (NVIDIA H200); use blockwise, "
        "or emulate=true for numerics only"
    )
    _, r = check_supported("blockwise", H100_OLD_CUDA)
    assert "CUDA >= 12.9" in r and "12.4" in r
    _, r = check_supported("mxfp8", RTX5090)
    assert "SM100" in r and "SM120" in r and "tensorwise" in r
    with pytest.raises(UnsupportedRecipeError, match="mxfp8 needs SM100"):
        require_supported("mxfp8", H200)
    assert require_supported("mxfp8", CPU).name == "mxfp8"


def test_emulate_false_on_cpu_is_an_error():
    ok, reason = check_supported(get_recipe("tensorwise", emulate=False), CPU)
    assert not ok and "emulate=false" in reason


def test_import_is_light():
    """Importing the package initialises no CUDA and imports neither TE nor Megatron."""
    code = (
        "import sys, torch, nemo_fp8_recipes as n;"
        "assert not torch.cuda.is_initialized();"
        "bad=[m for m in sys.modules if m.startswith(('transformer_engine','megatron','hydra','tensorboard'))];"
        "assert not bad, bad; print(n.list_recipes())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "text, width, want",
    [
        ("2.20.2", None, (2, 20, 2)),
        ("0.16.1.dev0", None, (0, 16, 1)),
        ("2.9.0+cu12", None, (2, 9, 0)),
        ("2rc1.5", None, (2,)),
        ("12", 2, (12, 0)),
        ("12.8.1", 2, (12, 8)),
        ((2, 9), None, (2, 9)),
        ("auto", None, None),
        (None, None, None),
        ("dev", None, None),
        ("", 2, None),
    ],
)
def test_one_version_parser_for_packages_cuda_and_user_input(text, width, want):
    from nemo_fp8_recipes.versions import version_tuple

    assert version_tuple(text, width=width) == want


def test_one_gpu_table_for_names_capabilities_and_peaks():
    from nemo_fp8_recipes.hardware import GPUS, gpu_by_device_name, gpu_by_key

    assert len({g.key for g in GPUS}) == len(GPUS)
    assert all(gpu_by_key(g.key) is g and gpu_by_device_name(g.name) is g for g in GPUS)  # order: specific first
    assert gpu_by_key("NVIDIA H100-SXM5-80GB").key == "h100" and gpu_by_key("L40S").key == "l40s"
    assert gpu_by_key("v100") is None and gpu_by_device_name("Tesla V100-SXM2-16GB") is None
    # a suffix may not continue the model number; a separated one (80GB) may start with a digit
    assert gpu_by_key("h1000x") is None and gpu_by_key("l40") is None and gpu_by_key("b2000") is None
    assert gpu_by_key("H100 80GB").key == "h100" and gpu_by_key("h100_nvl").key == "h100nvl"
    assert gpu_by_key("H100SXM").key == "h100" and gpu_by_key("nvidia-gb200").key == "gb200"
    from nemo_fp8_recipes.hardware import device_from_name

    assert device_from_name("NVIDIA H100 80GB").name == "NVIDIA H100" and device_from_name("h1000") is None
    for reported, key in (
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100pcie"),
        ("NVIDIA H100 NVL", "h100nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", "gb200"),
    ):
        assert gpu_by_device_name(reported).key == key, reported
    assert gpu_by_device_name("NVIDIA H200").peak_tflops == {"bf16": 989.4, "fp8": 1978.9}
    assert "fp8" not in gpu_by_device_name("NVIDIA A100-SXM4-80GB").peak_tflops  # no FP8 on Ampere


def test_check_supported_takes_a_gpus_name_like_nemo_fp8_check():
    """check_supported(recipe, device="h100") answers for that GPU (as nemo-fp8-check --gpu does),
    and a name that is neither a torch device nor a GPU is a ValueError listing both kinds."""
    from nemo_fp8_recipes.recipes import check_supported

    ok, why = check_supported("blockwise", device="h100")
    assert ok and "SM90" in why
    ok, why = check_supported("mxfp8", device="H200")
    assert not ok and "mxfp8 needs SM100" in why
    assert check_supported("mxfp8", device="sm100")[0]
    with pytest.raises(ValueError, match=r"unknown device 'tpu7'.*torch device.*h100.*smNN"):
        check_supported("blockwise", device="tpu7")


def test_numerics_warnings_name_e4m3_gradients_with_a_margin_under_a_max_history():
    """Only delayed scaling with E4M3 gradients, a margin and the max over a history longer than
    one step is warned about (the run-level evidence: tests/trainer/test_train.py)."""
    for name in list_recipes():
        assert get_recipe(name).numerics_warnings() == [], name
    (w,) = get_recipe("delayed", grad_format="e4m3", margin=2).numerics_warnings()
    assert "margin=2" in w and "1024-step" in w and "margin=0, grad_format=e5m2" in w
    for harmless in (
        dict(grad_format="e4m3", margin=0),
        dict(grad_format="e5m2", margin=8),
        dict(grad_format="e4m3", margin=8, amax_compute_algo="most_recent"),
        dict(grad_format="e4m3", margin=8, amax_history_len=1),
    ):
        assert get_recipe("delayed", **harmless).numerics_warnings() == [], harmless
