"""Why the ``gpu`` and ``te`` tests cannot run on this machine (None when they can)."""

import torch


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none found: CPU-only machine); run these tests on a CUDA GPU"
    return None


def te_skip_reason():
    """Why the ``te`` tests cannot run here (None when Transformer Engine imports on a GPU)."""
    gpu = gpu_skip_reason()
    if gpu is not None:
        return f"Transformer Engine {gpu}"
    from nemo_fp8_recipes.integrations.te import te_available

    ok, why = te_available()
    return None if ok else f"Transformer Engine is not importable here ({why}); pip install '.[te]' on this GPU machine"
