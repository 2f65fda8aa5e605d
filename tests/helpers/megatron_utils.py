"""CPU-only helpers for building tiny, real Megatron-Core ``GPTModel`` instances in tests.

Self-contained (no conftest / package needed): import it from a test module as
``from helpers.megatron_utils import ...`` (pytest puts ``tests/`` on ``sys.path`` in rootdir mode)
or via an explicit ``sys.path`` insert.

What Megatron needs, and what this module does about it:

* ``torch.distributed`` initialised: a single-process gloo group via ``env://`` on
  ``127.0.0.1`` and a free port picked at runtime (only if no group exists yet).
* ``parallel_state.initialize_model_parallel(1, 1)`` (only if not initialised yet).
* RNG: ``tensor_parallel.model_parallel_cuda_manual_seed`` calls ``torch.cuda`` and fails on a
  CPU-only torch build. It is not needed for construction when
  ``TransformerConfig(use_cpu_initialization=True)``: weights are then drawn with the ordinary
  CPU generator, so we seed that with ``torch.manual_seed`` instead.

Known limit: only construction works on CPU. The forward pass of the local spec calls
``torch.cuda.current_device()`` (``DotProductAttention`` global memory buffer, router weight move),
so forward needs a GPU.
"""

from __future__ import annotations

import os
import socket
from typing import Tuple

_DIST_INITIALISED_HERE = False


def megatron_available() -> Tuple[bool, str]:
    """Return ``(True, version info)`` if megatron-core's GPT pieces import, else ``(False, why)``.

    Use for clean skips: ``ok, why = megatron_available(); pytest.skip(why)`` when not ok.
    """
    try:
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
        from megatron.core.transformer import TransformerConfig  # noqa: F401
    except Exception as exc:  # ImportError, or anything raised at import time
        return False, f"megatron-core not importable: {type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        ver = version("megatron-core")
    except Exception:
        ver = "unknown"
    return True, f"megatron-core {ver}"


def _free_port() -> int:
    """Ask the OS for a currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_megatron_cpu(seed: int = 1234) -> None:
    """Idempotently set up a 1-rank gloo process group and TP=PP=1 model-parallel state.

    Safe to call before every model build; it only initialises what is missing, and seeds the
    CPU RNG so that models built with the same seed are identical.
    """
    global _DIST_INITIALISED_HERE
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(backend="gloo", init_method="env://", rank=0, world_size=1)
        _DIST_INITIALISED_HERE = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)


def teardown_megatron(destroy_process_group: bool = False) -> None:
    """Destroy Megatron's model-parallel state (a later build re-initialises it).

    The gloo process group is kept by default, so several tests/modules in one pytest session can
    keep building models cheaply; pass ``destroy_process_group=True`` at the very end of a session
    to also destroy it (only if this module created it).
    """
    global _DIST_INITIALISED_HERE
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if destroy_process_group and _DIST_INITIALISED_HERE and dist.is_initialized():
        dist.destroy_process_group()
        _DIST_INITIALISED_HERE = False


def build_tiny_gpt_model(
    num_layers: int = 4,
    hidden_size: int = 128,
    ffn_hidden_size: int = 256,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    vocab_size: int = 512,
    seq_length: int = 64,
    moe: bool = False,
    num_moe_experts: int = 4,
    moe_router_topk: int = 2,
    **config_overrides,
):
    """Build a real ``megatron.core.models.gpt.GPTModel`` on CPU with the local (non-TE) spec.

    Dense layers use ``get_gpt_layer_local_spec()``; with ``moe=True`` the MLP of every layer is a
    ``MoELayer`` (``TopKRouter`` + ``SequentialMLP`` of ``num_moe_experts`` local MLP experts).
    ``config_overrides`` go straight into ``TransformerConfig`` (e.g. ``fp8="hybrid"``,
    ``add_bias_linear=False``); a ``seed`` keyword (default 1234) is taken out first and used to
    seed the CPU RNG. TP = PP = 1, fp32 params, ``use_cpu_initialization=True``.
    """
    init_megatron_cpu(seed=config_overrides.pop("seed", 1234))

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg_kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        use_cpu_initialization=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )
    if moe:
        cfg_kwargs.update(num_moe_experts=num_moe_experts, moe_router_topk=moe_router_topk)
    cfg_kwargs.update(config_overrides)
    config = TransformerConfig(**cfg_kwargs)

    spec = get_gpt_layer_local_spec(num_experts=num_moe_experts if moe else None, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
    )
