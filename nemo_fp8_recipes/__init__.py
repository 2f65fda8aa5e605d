"""nemo_fp8_recipes: FP8 training recipes for NeMo / Megatron and plain PyTorch.

Importing the package needs no GPU, no Transformer Engine and no Megatron, and does not
initialise CUDA. Quick start::

    import nemo_fp8_recipes as nfr
    model = nfr.convert_model(model, nfr.get_recipe("blockwise"))
    ...  # train as usual
    print(nfr.audit(model).table())
"""

from .integrations.megatron import megatron_config
from .integrations.te import to_te_recipe
from .integrations.validate import validate
from .nn import (
    AuditReport,
    Float8Linear,
    Float8LinearConfig,
    PolicyViolation,
    audit,
    collect_telemetry,
    convert_model,
    set_amax_reduce_fn,
    set_delayed_scaling_update,
    set_telemetry,
    set_wgrad_accumulation_fusion,
    sync_delayed_scaling,
)
from .policy import Decision, PrecisionPolicy
from .recipes import (
    Recipe,
    RecipeName,
    ScalingKind,
    UnsupportedRecipeError,
    check_supported,
    get_recipe,
    list_recipes,
    require_supported,
)

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "Decision",
    "Float8Linear",
    "Float8LinearConfig",
    "PolicyViolation",
    "PrecisionPolicy",
    "Recipe",
    "RecipeName",
    "ScalingKind",
    "UnsupportedRecipeError",
    "audit",
    "check_supported",
    "collect_telemetry",
    "convert_model",
    "get_recipe",
    "list_recipes",
    "megatron_config",
    "require_supported",
    "set_amax_reduce_fn",
    "set_delayed_scaling_update",
    "set_telemetry",
    "set_wgrad_accumulation_fusion",
    "sync_delayed_scaling",
    "to_te_recipe",
    "validate",
]
