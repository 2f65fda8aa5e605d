"""The direct launch of the Triton quantisers (nemo_fp8_recipes.quant.launch).

Everywhere: the switch and the status it reports; interpreted kernels (CI's TRITON_INTERPRET=1)
always take Triton's own path. On a GPU: after its first launch, a specialisation is launched
directly (counted), with codes and scales byte-identical to Triton's own launch path and to the
reference quantiser — for a second specialisation of the same kernel (a pointer that is not
16-byte aligned, a length not divisible by 16), on a side stream, inside a CUDA graph — and a
registered Triton launch hook sends every launch through Triton's path, where the hook sees it."""

import os

import pytest
import torch
from helpers.fp8_ref import structured

from nemo_fp8_recipes.quant import launch as fl
from nemo_fp8_recipes.quant.reference import quantize

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

ON_GPU = torch.cuda.is_available()


@pytest.fixture
def restore_switch():
    prev = fl.set_fast_launch(True)
    yield
    fl.set_fast_launch(prev)


def test_switch_and_status(restore_switch):
    assert fl.set_fast_launch(False) is True
    assert fl.fast_launch_status().startswith("off: disabled")
    assert "KernelOptions(fast_launch=False)" in fl.fast_launch_status()
    assert fl.set_fast_launch(True) is False
    status = fl.fast_launch_status()
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert status == "off: TRITON_INTERPRET=1 (interpreted kernels)"
    else:
        assert status == "on"


@pytest.mark.skipif(
    ON_GPU or os.environ.get("TRITON_INTERPRET") != "1",
    reason="checks the interpreter's path (CPU with TRITON_INTERPRET=1)",
)
def test_interpreted_kernels_take_tritons_path(restore_switch):
    from nemo_fp8_recipes.quant import triton_kernels as tk

    x = structured(64, 256, seed=1).to(torch.bfloat16)
    fl.launch_counts(reset=True)
    a, b = tk.quantize_tensor_dual(x, "e4m3")
    counts = fl.launch_counts()
    assert counts == {"direct": 0, "triton": 2}  # amax pass + cast, both through kernel[grid]
    ref = quantize(x.float(), "e4m3", "tensor")
    assert torch.equal(a.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(b.data.view(torch.uint8), ref.data.t().contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu


def _tk():
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU (the direct launch runs compiled kernels)")
    from nemo_fp8_recipes.quant import triton_kernels as tk

    return tk


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _outputs(res):
    """Every tensor of a quantiser's result, flattened (QuantizedTensors, tuples, tensors)."""
    if res is None:
        return []
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (tuple, list)):
        return [t for r in res for t in _outputs(r)]
    return [t for t in (res.data, res.scale_inv, res.amax, res.scale_e8m0) if t is not None]


def _cases(tk):
    """Each quantiser as a function of its input."""

    def w(x):
        return torch.linspace(-2, 2, x.shape[1], device=x.device)

    def s(x):
        return torch.tensor(0.25, device=x.device)

    return {
        "tensor_dual current": lambda x: tk.quantize_tensor_dual(x, "e4m3"),
        "tensor_dual delayed": lambda x: tk.quantize_tensor_dual(
            x, "e4m3", scale=s(x), amax_out=torch.zeros(1, device=x.device)
        ),
        "tensor current": lambda x: tk.quantize_tensor(x, "e5m2"),
        "rows 1x128": lambda x: tk.quantize_rows(x, "e4m3", 128, "fp32"),
        "rows 1x32 e8m0": lambda x: tk.quantize_rows(x, "e4m3", 32, "e8m0_ceil"),
        "cols_t 1x128": lambda x: tk.quantize_cols_t(x, "e4m3", 128, "pow2"),
        "blocks128": lambda x: tk.quantize_blocks128(x, "e4m3", "fp32", transposed=True),
        "rmsnorm fwd + amax": lambda x: tk.rmsnorm_forward(x, w(x), 1e-5, amax=True),
    }


@gpu
def test_direct_launch_is_byte_identical_and_taken(restore_switch):
    """Warmed up on one input, checked on another: a direct launch that wrote nothing (or only
    part of the grid) would leave the warm-up's bytes in the recycled output memory, which
    differ from the new input's; Triton's results on the new input stay alive meanwhile, so
    their memory is not what the direct launch gets."""
    tk = _tk()
    warm = structured(512, 1024, seed=3).to("cuda", torch.bfloat16)
    x = structured(512, 1024, seed=4).to("cuda", torch.bfloat16)
    for name, fn in _cases(tk).items():
        fl.set_fast_launch(True)
        fn(warm), fn(warm)  # first launches of each specialisation: Triton's path, then cached
        fl.set_fast_launch(False)
        want = _outputs(fn(x))
        fl.set_fast_launch(True)
        fl.launch_counts(reset=True)
        got = _outputs(fn(x))
        counts = fl.launch_counts()
        assert counts["triton"] == 0 and counts["direct"] >= 1, f"{name}: {counts}"
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(_bytes(g), _bytes(w)), name


@gpu
def test_each_specialisation_gets_its_own_kernel(restore_switch):
    """Triton specialises on 16-byte pointer alignment and on lengths divisible by 16: a cached
    kernel compiled for aligned operands must not run a misaligned one."""
    tk = _tk()
    fl.set_fast_launch(True)
    x = structured(256, 512, seed=5).to("cuda", torch.bfloat16)
    buf = torch.empty(x.numel() + 1, device="cuda", dtype=torch.bfloat16)
    buf[1:].copy_(x.flatten())
    x_off = buf[1:].view(256, 512)  # contiguous, 2 bytes past a 16-byte boundary
    assert x_off.data_ptr() % 16 != 0
    odd = structured(255, 500, seed=6).to("cuda", torch.bfloat16)  # lengths not divisible by 16
    for src in (x, x, x, x_off, x_off, x_off, odd, odd, odd):
        a = tk.quantize_tensor(src, "e4m3")
        ref = quantize(src.float(), "e4m3", "tensor")
        assert torch.equal(a.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(a.scale_inv, ref.scale_inv.to(a.scale_inv.device))
    keys = [k for k in fl._CACHE.get(tk.tensor.cast_kernel, {})]
    specs = {k[1] for k in keys}
    assert len(specs) >= 3, specs  # aligned, misaligned, odd length: three compiled kernels


@gpu
def test_side_stream_and_cuda_graph(restore_switch):
    tk = _tk()
    fl.set_fast_launch(True)
    x = structured(384, 768, seed=8).to("cuda", torch.bfloat16)
    ref = quantize(x.float(), "e4m3", "1x128", "pow2").data.view(torch.uint8).cpu()
    for _ in range(3):
        tk.quantize_rows(x, "e4m3", 128, "pow2")
    torch.cuda.synchronize()
    # the launch must go to the current (side) stream: the default stream is kept busy, so a
    # kernel queued there would not have run when the side stream is synchronised
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time on the default stream
    with torch.cuda.stream(side):
        fl.launch_counts(reset=True)
        q = tk.quantize_rows(x, "e4m3", 128, "pow2")
        assert fl.launch_counts()["direct"] == 1
        side.synchronize()
        got = q.data.view(torch.uint8).cpu()
    assert not torch.cuda.current_stream().query(), "the default stream finished first: the check proves nothing"
    assert torch.equal(got, ref)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qg = tk.quantize_rows(x, "e4m3", 128, "pow2")
    x2 = structured(384, 768, seed=9).to("cuda", torch.bfloat16)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    ref2 = quantize(x2.float(), "e4m3", "1x128", "pow2")
    assert torch.equal(qg.data.view(torch.uint8), ref2.data.view(torch.uint8))
    assert torch.equal(qg.scale_inv, ref2.scale_inv.to(qg.scale_inv.device))


def _rows_warmed(seed):
    """The 1x128 rows quantiser launched three times on a fresh 128x256 input (its
    specialisation cached, so the next launch is direct): ``(triton_kernels, x)``."""
    tk = _tk()
    fl.set_fast_launch(True)
    x = structured(128, 256, seed=seed).to("cuda", torch.bfloat16)
    for _ in range(3):
        tk.quantize_rows(x, "e4m3", 128, "fp32")
    return tk, x


@gpu
def test_launch_hook_sends_launches_through_triton(restore_switch):
    tk, x = _rows_warmed(11)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"] if hasattr(metadata, "get") else metadata)

    from triton import knobs

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fl.fast_launch_status().startswith("off: Triton launch hooks")
        fl.launch_counts(reset=True)
        tk.quantize_rows(x, "e4m3", 128, "fp32")
        assert fl.launch_counts() == {"direct": 0, "triton": 1}
        assert len(seen) == 1
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fl.fast_launch_status() == "on"


@gpu
def test_hook_assigned_as_plain_function_and_pre_run_hooks(restore_switch):
    """A launch hook assigned as a plain function (the pre-HookChain style) and a kernel's
    pre-run hook both send launches through Triton's path, which calls them."""
    tk, x = _rows_warmed(12)
    from triton import knobs

    seen = []
    old = knobs.runtime.launch_exit_hook
    knobs.runtime.launch_exit_hook = lambda *a: seen.append("exit")
    try:
        fl.launch_counts(reset=True)
        tk.quantize_rows(x, "e4m3", 128, "fp32")
        assert fl.launch_counts() == {"direct": 0, "triton": 1} and seen == ["exit"]
    finally:
        knobs.runtime.launch_exit_hook = old
    kernel = tk.groups.quant_rows_kernel
    kernel.add_pre_run_hook(lambda *a, **k: seen.append("pre"))
    try:
        fl.launch_counts(reset=True)
        tk.quantize_rows(x, "e4m3", 128, "fp32")
        assert fl.launch_counts() == {"direct": 0, "triton": 1} and seen[-1] == "pre"
    finally:
        kernel.pre_run_hooks.clear()
    fl.launch_counts(reset=True)
    tk.quantize_rows(x, "e4m3", 128, "fp32")
    assert fl.launch_counts() == {"direct": 1, "triton": 0}


@gpu
def test_debug_knob_gets_its_own_kernel(restore_switch):
    """Turning Triton's debug mode on mid-process launches the kernel compiled for it (the key
    includes the options JITFunction.run adds), not the cached non-debug one."""
    tk, x = _rows_warmed(13)
    from triton import knobs

    with knobs.runtime.scope():
        knobs.runtime.debug = True
        fl.launch_counts(reset=True)
        q = tk.quantize_rows(x, "e4m3", 128, "fp32")
        assert fl.launch_counts() == {"direct": 0, "triton": 1}  # a new specialisation
        tk.quantize_rows(x, "e4m3", 128, "fp32")
        assert fl.launch_counts()["direct"] == 1
    keys = list(fl._CACHE[tk.groups.quant_rows_kernel])
    assert {k[3] for k in keys} >= {False, True}
    ref = quantize(x.float(), "e4m3", "1x128", "fp32")
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
