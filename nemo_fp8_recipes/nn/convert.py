"""``convert_model`` for the native backend, and the whole-model switches of a converted model.

``convert_model`` asks the precision policy about every module, swaps the ``nn.Linear``s it
puts in FP8 for :class:`Float8Linear` (same Parameter objects), and installs counters on the
GEMMs it keeps in high precision, so that :func:`~nemo_fp8_recipes.nn.audit` can report, after a
forward/backward, how many fprop/dgrad/wgrad GEMMs actually ran in FP8 and how many in high
precision (:mod:`nemo_fp8_recipes.nn.audit`; telemetry: :mod:`nemo_fp8_recipes.nn.telemetry`).

Every FP8 linear of a converted model runs with one :class:`~nemo_fp8_recipes.nn.Float8LinearConfig`,
built here from ``convert_model``'s arguments (the recipe resolved for the device, the kernel
options, and the run-time settings: telemetry, the compiled weight cache, fused wgrad
accumulation, the delayed-scaling schedule and its amax reduction). The whole-model ``set_*``
functions below change a setting afterwards; each is a thin wrapper over
:meth:`Float8Linear.reconfigure <nemo_fp8_recipes.nn.Float8Linear.reconfigure>`.

GEMM modules of other classes (Megatron's parallel linears, a project's own linear) are put in
FP8 through ``swaps``: a mapping from the class to a :data:`SwapFactory` that builds its FP8
replacement. The policy decision, the audit record and the counters stay here, made once per
module, whichever class is swapped; integrations supply only the factory
(:func:`nemo_fp8_recipes.integrations.megatron.convert_megatron_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..options import KernelOptions, default_kernel_options
from ..policy import GEMM_ROLES, Decision, PrecisionPolicy, Role, grouped_weight_names, layer_index
from ..quant.launch import set_fast_launch
from ..recipes import Recipe, get_recipe, require_supported, uses_real_fp8_gemm
from .config import Float8LinearConfig
from .grouped import Float8GroupedExperts, fp8_state_modules, grouped_layout_problem
from .linear import Float8Linear, fp8_modules
from .wgrad_fusion import check_wgrad_fusion

__all__ = [
    "SwapFactory",
    "apply_kernel_options",
    "conversion_state",
    "convert_model",
    "grouped_decision",
    "hp_gemm_counts",
    "infer_num_layers",
    "invalidate_weight_cache",
    "reset_gemm_counts",
    "set_amax_reduce_fn",
    "set_graph_weight_cache",
    "set_submodule",
    "set_wgrad_accumulation_fusion",
]

_STATE_ATTR = "_nemo_fp8_state"

#: Builds the FP8 replacement of one module the policy put in FP8:
#: ``factory(fqn, module, decision, config) -> Float8Linear`` (or, for a module with 3-D grouped
#: expert weights, a :class:`~nemo_fp8_recipes.nn.Float8GroupedExperts`). ``config`` is the model's
#: :class:`~nemo_fp8_recipes.nn.Float8LinearConfig` (the resolved recipe, whether the GEMMs are
#: emulated on this device, the kernel options and run-time settings): build the replacement with
#: it (``Float8Linear.from_parameters(weight, bias, config)``). The replacement shares
#: ``module``'s Parameter objects, so an optimizer built before conversion keeps working.
#: :func:`convert_model` sets its ``fqn`` and ``role`` and registers the module's forward hooks on it.
SwapFactory = Callable[[str, nn.Module, Decision, Float8LinearConfig], Union[Float8Linear, Float8GroupedExperts]]


@dataclass
class _ConvertState:
    recipe: Recipe
    policy: PrecisionPolicy
    emulate: bool
    options: KernelOptions = field(default_factory=KernelOptions)
    decisions: Dict[str, Decision] = field(default_factory=dict)
    hp_modules: Dict[str, nn.Module] = field(default_factory=dict)
    unplaced: Dict[str, str] = field(default_factory=dict)
    hooks: list = field(default_factory=list)


def infer_num_layers(model: nn.Module) -> Optional[int]:
    """The number of transformer layers of ``model``, read from its module names (``layers.<i>``),
    or None: what the policy's first/last-layer rules count from."""
    idx = [layer_index(n) for n, _ in model.named_modules()]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None


def set_submodule(root: nn.Module, fqn: str, new: nn.Module) -> None:
    """Replace the submodule at ``fqn`` (``layers.0.mlp.w1``) of ``root`` with ``new``."""
    parent_name, _, leaf = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def _swap_linear(fqn: str, module: nn.Module, decision: Decision, config: Float8LinearConfig) -> Float8Linear:
    """The built-in swap: an ``nn.Linear`` becomes a :class:`Float8Linear`."""
    return Float8Linear.from_linear(module, config=config, fqn=fqn)


def _swap_grouped(fqn: str, module: nn.Module, decision: Decision, config: Float8LinearConfig):
    """The built-in swap of a transformers 5 experts module: a :class:`Float8GroupedExperts`."""
    return Float8GroupedExperts.from_experts(module, config)


def grouped_decision(
    policy: PrecisionPolicy, fqn: str, module: nn.Module, recipe: Recipe, names: Tuple[str, ...]
) -> Decision:
    """The policy's decision for a module with the 3-D grouped weights ``names``: each weight's
    ``(out_features, in_features)`` is checked; the first that keeps it out of FP8 decides."""
    decision = None
    for name in names:
        w = getattr(module, name)
        d = policy.decide(fqn, module, recipe=recipe, shape=(int(w.shape[1]), int(w.shape[2])))
        if not d.fp8:
            return Decision(
                d.fqn, d.role, d.precision, f"{name}: {d.reason}" if "features" in d.reason else d.reason, d.layer
            )
        decision = decision or d
    return decision


def _find_swap(swaps: Mapping[type, SwapFactory], module: nn.Module) -> Optional[SwapFactory]:
    """The factory of the most specific class of ``module`` that ``swaps`` names (its MRO order),
    or None."""
    for cls in type(module).__mro__:
        if cls in swaps:
            return swaps[cls]
    return None


def _gemm_shape(module: nn.Module) -> Optional[Tuple[int, int]]:
    """``(out_features, in_features)`` of a swappable module, read from its 2-D ``weight``
    (``[out, in]``, the layout of the Float8Linear that replaces it), for the policy's alignment
    check; None without one (e.g. Megatron's output layer when it borrows the embedding weight)."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0]), int(w.shape[1])
    return None


def _carry_forward_hooks(old: nn.Module, new: nn.Module) -> None:
    """Register ``old``'s forward (pre-)hooks on ``new``, with their ``with_kwargs`` /
    ``always_call`` flags, so hooks a user put on the original module keep running."""
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    new._forward_pre_hooks_with_kwargs.update(old._forward_pre_hooks_with_kwargs)
    new._forward_hooks.update(old._forward_hooks)
    new._forward_hooks_with_kwargs.update(old._forward_hooks_with_kwargs)
    new._forward_hooks_always_called.update(old._forward_hooks_always_called)


#: Buffers (not in ``state_dict``) on every GEMM module kept in high precision: forward calls,
#: and [dgrad, wgrad] runs. Two buffers, so none is mutated in both forward and backward.
HP_FWD_COUNT, HP_BWD_COUNT = "hp_fwd_count", "hp_bwd_count"


def _install_hp_counter(state: _ConvertState, fqn: str, module: nn.Module, device=None) -> None:
    """Count the GEMMs of a module kept in high precision, for :func:`audit`: forward calls in a
    forward hook, dgrad/wgrad in a gradient hook on its output. Both add to int64 buffers (a
    tensor mutation, which ``torch.compile`` keeps in its graph — a Python counter there breaks
    it); the output itself is left untouched (no wrapper, no view), so in-place ops on it and
    outputs that other ops saved for backward work as before."""
    p = next(module.parameters(), None)
    dev = p.device if p is not None else device
    module.register_buffer(HP_FWD_COUNT, torch.zeros(1, dtype=torch.int64, device=dev), persistent=False)
    module.register_buffer(HP_BWD_COUNT, torch.zeros(2, dtype=torch.int64, device=dev), persistent=False)
    state.hp_modules[fqn] = module

    # built on the meta device: the counters get memory from to_empty, uninitialised; the first
    # forward after that zeroes them
    module._hp_counts_unset = getattr(module, HP_FWD_COUNT).is_meta

    def fwd_hook(mod, inputs, output):
        if mod._hp_counts_unset and not getattr(mod, HP_FWD_COUNT).is_meta:
            with torch.no_grad():
                getattr(mod, HP_FWD_COUNT).zero_()
                getattr(mod, HP_BWD_COUNT).zero_()
            mod._hp_counts_unset = False
        getattr(mod, HP_FWD_COUNT).add_(1)
        # the first output gradients flow back through (a router may return its integer top-k
        # indices first, e.g. transformers 4's DeepSeek-V3 gate: (indices, weights))
        outs = output if isinstance(output, (tuple, list)) else (output,)
        out = next((o for o in outs if torch.is_tensor(o) and o.requires_grad), None)
        if out is not None:
            x = inputs[0] if inputs else None
            x_needs = torch.is_tensor(x) and x.requires_grad
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.Tensor):
                w_needs = w.requires_grad
            else:  # (grouped expert weights)
                w_needs = any(p.requires_grad for p in mod.parameters(recurse=False))
            counts = getattr(mod, HP_BWD_COUNT)

            def bwd(_grad):
                if x_needs:
                    counts[0].add_(1)
                if w_needs:
                    counts[1].add_(1)

            out.register_hook(bwd)

    state.hooks.append(module.register_forward_hook(fwd_hook))


def hp_gemm_counts(module: nn.Module) -> Dict[str, int]:
    """The audit's counts of a high-precision GEMM module (one host read of its two buffers)."""
    f, b = getattr(module, HP_FWD_COUNT), getattr(module, HP_BWD_COUNT)
    fwd, (dgrad, wgrad) = int(f.item()), b.tolist()
    return {"fprop": fwd, "dgrad": int(dgrad), "wgrad": int(wgrad)}


def convert_model(
    model: nn.Module,
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    emulate: Optional[bool] = None,
    device=None,
    options: Optional[KernelOptions] = None,
    swaps: Optional[Mapping[type, SwapFactory]] = None,
    *,
    telemetry: bool = False,
    graph_weight_cache: bool = False,
    fuse_wgrad_accumulation: bool = False,
    scaling_update: str = "lazy",
    amax_reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> nn.Module:
    """Apply ``recipe`` to ``model`` in place, as the precision ``policy`` decides; returns it.

    Every ``nn.Linear`` the policy puts in FP8 becomes a :class:`Float8Linear` sharing the same
    weight/bias Parameter objects (an optimizer built before conversion keeps working). GEMM
    modules kept in high precision get counters so :func:`audit` can prove what ran.

    ``swaps``: ``{module class: factory}`` (:data:`SwapFactory`) for GEMM modules that are not
    ``nn.Linear`` (or that need another replacement than :class:`Float8Linear`). A module takes
    the factory of the most specific of its classes named there, else the built-in one for
    ``nn.Linear``. Its policy decision is made once, with the alignment check on its 2-D
    ``weight`` (``[out, in]``); if FP8, the factory builds the replacement, which must be a
    :class:`Float8Linear` (that is what :func:`audit` and the telemetry count). A GEMM module
    with no factory stays in high precision, counted, and its audit reason says why.

    Grouped experts: a module with its own 3-D Parameters (``[experts, out, in]``) is a grouped
    GEMM module (role ``mlp``); the alignment check runs on every 3-D weight. One in transformers
    5's layout (``gate_up_proj`` / ``down_proj``, :func:`~nemo_fp8_recipes.nn.grouped.grouped_layout_problem`)
    becomes a :class:`~nemo_fp8_recipes.nn.Float8GroupedExperts`; any other class needs a
    ``swaps`` factory returning a ``Float8GroupedExperts``. Without one it stays in high
    precision, its audit reason says why, and ``audit(strict=True)`` fails on it.

    ``emulate``: None = real FP8 GEMMs where the hardware has them (``check_supported``), exact
    emulation on CPU; True = always emulate; False = demand real GEMMs. A GPU lacking the
    recipe's format raises :class:`~nemo_fp8_recipes.recipes.UnsupportedRecipeError` unless
    ``emulate=True`` (e.g. mxfp8 on Hopper). ``device`` defaults to the model's device.
    ``options``: the kernels the FP8 linears and the model's norms run
    (:class:`~nemo_fp8_recipes.options.KernelOptions`, applied with :func:`apply_kernel_options`;
    default :func:`~nemo_fp8_recipes.options.default_kernel_options`); :func:`audit` reports them.

    The keyword-only settings are those of :class:`~nemo_fp8_recipes.nn.Float8LinearConfig`, set
    here once for every FP8 linear (each has a whole-model ``set_*`` function to change it later):
    ``telemetry`` (:func:`set_telemetry`), ``graph_weight_cache`` (:func:`set_graph_weight_cache`;
    current scaling only), ``fuse_wgrad_accumulation`` (:func:`set_wgrad_accumulation_fusion`),
    ``scaling_update`` (``"lazy"`` or ``"step"``, :func:`set_delayed_scaling_update`) and
    ``amax_reduce_fn`` (:func:`set_amax_reduce_fn`). A bad value raises before the model changes.
    """
    r = get_recipe(recipe) if not isinstance(recipe, Recipe) else recipe
    if emulate is not None:
        r = r.replace(emulate=emulate)
    if policy is not None and not isinstance(policy, PrecisionPolicy):
        hint = "PrecisionPolicy(exclude=['output'])"
        if isinstance(policy, Mapping):
            hint = f"PrecisionPolicy(**{policy!r})"
        raise ValueError(
            f"policy must be a PrecisionPolicy or None, got {type(policy).__name__} {policy!r}: e.g. {hint} "
            "(BF16 everywhere is recipe='bf16')"
        )
    if isinstance(model, nn.Linear) or _find_swap(swaps or {}, model) is not None:
        raise ValueError(
            f"convert_model replaces a model's GEMM submodules in place, and the model given is itself a "
            f"{type(model).__name__}, which it cannot replace: wrap it (nn.Sequential(layer)) and convert that"
        )
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but this PyTorch has no CUDA GPU to use (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}): convert on the CPU (FP8 is emulated there) or on a machine with a GPU"
        )
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("convert_model was already applied to this model")
    for fqn, sub in model.named_modules():
        done = getattr(sub, _STATE_ATTR, None) if fqn else None
        if done is not None:
            raise RuntimeError(
                f"convert_model was already applied to the submodule {fqn!r} (recipe {done.recipe.name}): converting "
                f"the whole model now (recipe {r.name}) would leave that part under its own recipe and outside "
                "this model's audit. Convert the whole model once, and keep parts out of FP8 with the policy "
                "(PrecisionPolicy(exclude=[...]))"
            )
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None and p.device.type != "meta" else None
    require_supported(r, device)
    use_emulation = r.is_fp8 and not uses_real_fp8_gemm(r, device)
    policy = (policy or PrecisionPolicy()).with_num_layers(infer_num_layers(model))
    opts = options if options is not None else default_kernel_options()
    if not isinstance(opts, KernelOptions):
        raise TypeError(f"options must be a KernelOptions, got {type(opts).__name__}")
    for cls, factory in (swaps or {}).items():
        if not isinstance(cls, type) or not callable(factory):
            raise TypeError(f"swaps maps module classes to factories, got {cls!r}: {factory!r}")
    config = None
    if r.is_fp8:  # (validated here, before the model changes)
        config = Float8LinearConfig(
            recipe=r,
            emulate=use_emulation,
            kernel_options=opts,
            telemetry=telemetry,
            graph_weight_cache=graph_weight_cache,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            scaling_update=scaling_update,
            amax_reduce_fn=amax_reduce_fn,
        )
    factories: Dict[type, SwapFactory] = {nn.Linear: _swap_linear, **(swaps or {})}
    state = _ConvertState(recipe=r, policy=policy, emulate=use_emulation, options=opts)

    # Decide and build every replacement first, then change the model: a shape or factory error
    # leaves it as it was.
    plan = []  # (fqn, module, decision, FP8 replacement or None)
    replaced: Tuple[str, ...] = ()  # "<fqn>." of replaced modules: their submodules go with them
    for fqn, module in list(model.named_modules()):
        if not fqn or isinstance(module, (Float8Linear, Float8GroupedExperts)) or fqn.startswith(replaced):
            continue
        factory = _find_swap(factories, module)
        grouped = grouped_weight_names(module)  # (names of its 3-D weights; () for any other module)
        layout_problem = grouped_layout_problem(module) if grouped and factory is None else None
        if grouped and factory is None and layout_problem is None:
            factory = _swap_grouped
        # nn.Linear: the policy reads out_features / in_features itself
        shape = _gemm_shape(module) if factory is not None and not isinstance(module, nn.Linear) else None
        if grouped:
            decision = grouped_decision(policy, fqn, module, r, grouped)
        else:
            decision = policy.decide(fqn, module, recipe=r, shape=shape)
        if decision.role == Role.OTHER:
            if factory is not None and factory is not _swap_linear:
                raise ValueError(
                    f"{fqn}: convert_model's swaps name {type(module).__name__}, but the policy does not "
                    f"classify it as a GEMM module ({decision.reason}); it recognises nn.Linear and classes "
                    "whose name ends in 'Linear', so name the class so or drop it from swaps"
                )
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and decision.role in GEMM_ROLES:
            continue
        if decision.fp8 and factory is None and grouped:
            why = (
                f"{type(module).__name__} holds grouped GEMM weights ({', '.join(grouped)}, "
                f"3-D) that convert_model cannot run in FP8: {layout_problem}; pass "
                f"swaps={{{type(module).__name__}: factory}} returning a Float8GroupedExperts, or keep it in BF16 "
                "with PrecisionPolicy(exclude=[...])"
            )
            decision = Decision(fqn, decision.role, "bf16", why, decision.layer)
            state.unplaced[fqn] = why
        elif decision.fp8 and factory is None:
            decision = Decision(
                fqn,
                decision.role,
                "bf16",
                f"{type(module).__name__} is not an nn.Linear and convert_model has no swap for it: the "
                "native backend converts nn.Linear and the classes in swaps= (use the Megatron integration "
                "for Megatron layers)",
                decision.layer,
            )
        new = None
        if decision.fp8:
            if shape is None and not isinstance(module, nn.Linear) and not grouped:
                w = getattr(module, "weight", None)
                got = (
                    "no weight"
                    if w is None
                    else f"a weight {type(w).__name__} of shape {tuple(getattr(w, 'shape', ()))}"
                )
                raise TypeError(
                    f"{fqn}: the policy puts this {type(module).__name__} in FP8 but it has {got}; a "
                    "module in convert_model's swaps keeps its GEMM weight in .weight as a 2-D "
                    "[out_features, in_features] tensor (keep it in BF16 with PrecisionPolicy(exclude=[...]))"
                )
            new = factory(fqn, module, decision, config)
            if not isinstance(new, (Float8GroupedExperts if grouped else Float8Linear)):
                want = "Float8GroupedExperts" if grouped else "Float8Linear"
                raise TypeError(
                    f"{fqn}: the swap for {type(module).__name__} returned {type(new).__name__}, not a "
                    f"{want} (or subclass), which audit() counts as FP8"
                )
            replaced += (fqn + ".",)
        plan.append((fqn, module, decision, new))

    _warn_about_nothing_done(model, r, policy, [decision for _, _, decision, _ in plan])
    for fqn, module, decision, new in plan:
        state.decisions[fqn] = decision
        if new is not None:
            new.fqn, new.role = fqn, decision.role
            _carry_forward_hooks(module, new)
            set_submodule(model, fqn, new)
        elif decision.role in GEMM_ROLES:
            _install_hp_counter(state, fqn, module, device)
    object.__setattr__(model, _STATE_ATTR, state)
    # DDP broadcasts buffers from rank 0 before every forward; the delayed-scaling state is
    # per-rank until the amax reduction, and the GEMM counters are per rank, so keep them out of
    # that broadcast.
    fp8_buffers = [
        f"{n}.{b}"
        for n, m in model.named_modules()
        if isinstance(m, (Float8Linear, Float8GroupedExperts))
        for b, _ in m.named_buffers(recurse=False)
    ]
    fp8_buffers += [f"{n}.{b}" for n in state.hp_modules for b in (HP_FWD_COUNT, HP_BWD_COUNT)]
    _ddp_ignore(model, fp8_buffers)
    apply_kernel_options(model, opts)
    return model


def _warn_about_nothing_done(model: nn.Module, recipe: Recipe, policy: PrecisionPolicy, decisions) -> None:
    """A policy pattern that names no module, and an FP8 recipe under which no GEMM runs in FP8,
    are almost always mistakes (a typo, a model without the expected names or shapes): say so."""
    import warnings

    names = [fqn for fqn, _ in model.named_modules() if fqn]
    for key in ("include", "exclude"):
        for pattern in getattr(policy, key):
            if policy.first_match(names, pattern) is None:
                warnings.warn(
                    f"policy {key} pattern {pattern!r} matches no module of the model (its modules are named like "
                    f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''})",
                    UserWarning,
                    stacklevel=3,
                )
    gemms = [d for d in decisions if d.role in GEMM_ROLES]
    if recipe.is_fp8 and not any(d.fp8 for d in gemms):
        why = sorted({d.reason for d in gemms})
        warnings.warn(
            f"recipe {recipe.name}: no GEMM of the model runs in FP8 ({len(gemms)} GEMM module(s) kept in high "
            f"precision: {'; '.join(why[:3]) or 'the model has no nn.Linear'}); audit(model) lists each one",
            UserWarning,
            stacklevel=3,
        )


def apply_kernel_options(model: nn.Module, options: KernelOptions) -> int:
    """Run ``model``'s FP8 linears and norms with ``options``
    (:class:`~nemo_fp8_recipes.options.KernelOptions`): ``reconfigure(kernel_options=options)`` on
    every FP8 linear, ``kernel_options`` on every other module that has it (the norms), records
    them for :func:`audit` (converted models), and sets the process-wide direct launch of the
    Triton kernels (``options.fast_launch``). Returns how many modules took them. For a model that
    is not converted (BF16) it sets the norms' options; ``convert_model(..., options=...)`` applies
    them at conversion."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"options must be a KernelOptions, got {type(options).__name__}")
    n = 0
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.reconfigure(kernel_options=options)
            n += 1
        elif isinstance(getattr(m, "kernel_options", None), KernelOptions):
            m.kernel_options = options
            n += 1
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        state.options = options
    set_fast_launch(options.fast_launch)
    return n


def _ddp_ignore(model: nn.Module, names) -> None:
    """Add buffer names (``"<module fqn>.<buffer>"``) to the ones DDP leaves out of its buffer
    broadcast from rank 0 (``_ddp_params_and_buffers_to_ignore``), each once."""
    ignore = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    new = [b for b in names if b not in ignore]
    if new:
        model._ddp_params_and_buffers_to_ignore = ignore + new


def invalidate_weight_cache(model: nn.Module) -> None:
    """Make every Float8Linear re-quantise its weight: the eager cache at the next forward, the
    compiled path's (:func:`set_graph_weight_cache`) at once. Call it after writing weights
    through ``.data`` (e.g. copying master weights in place), which the eager version-counter
    check cannot see, and with the compiled cache on after any in-place write; optimizer steps
    and ``load_state_dict`` need no call."""
    for m in fp8_modules(model).values():
        m.invalidate_weight_cache()


def set_graph_weight_cache(model: nn.Module, enabled: bool = True) -> int:
    """FP8 weight caching across micro-batches for ``torch.compile``: every current-scaling
    Float8Linear (tensorwise, blockwise, mxfp8) of ``model`` keeps its FP8 weight in buffers
    that its compiled forward reads instead of quantising the weight in the graph
    (:meth:`Float8Linear.set_graph_weight_cache`). They are re-quantised after each optimizer
    step that updates the weight, after ``load_state_dict`` and ``.to()``, and by
    :func:`invalidate_weight_cache` — so with K micro-batches per optimizer step each weight is
    quantised once instead of K times. The eager path caches its FP8 weights already; delayed
    scaling's modules (an eager island) are left as they are. Costs the two FP8 copies (2 bytes
    per parameter) between steps. Any other in-place write to a weight needs
    :func:`invalidate_weight_cache`; :func:`audit` reports a stale cache. The buffers are kept
    out of DDP's buffer broadcast (each rank quantises its own identical weights). Returns the
    number of modules set. Call it after moving the model to its device and before wrapping it in
    DDP and compiling it (turning it on or off later makes the compiler re-trace once). A thin
    wrapper, ``reconfigure(graph_weight_cache=enabled)`` on each; ``convert_model(...,
    graph_weight_cache=True)`` turns it on at conversion."""
    n, names = 0, []
    for fqn, m in fp8_modules(model).items():
        if m.recipe.is_delayed:
            continue
        m.reconfigure(graph_weight_cache=bool(enabled))
        names += [f"{fqn}.{b}" for b in m.GRAPH_WEIGHT_CACHE_BUFFERS]
        n += 1
    if enabled:  # every rank quantises its own (identical) copy: out of DDP's buffer broadcast
        _ddp_ignore(model, names)
    return n


def conversion_state(model: nn.Module):
    """What :func:`convert_model` recorded on ``model`` (recipe, resolved policy, emulate, the
    decision per module, the high-precision modules it counts), or None if never converted."""
    return getattr(model, _STATE_ATTR, None)


def reset_gemm_counts(model: nn.Module) -> None:
    """Zero the per-GEMM counters that :func:`audit` reports."""
    for m in fp8_state_modules(model).values():
        m.reset_gemm_counts()
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        for m in state.hp_modules.values():
            getattr(m, HP_FWD_COUNT).zero_()
            getattr(m, HP_BWD_COUNT).zero_()


def set_wgrad_accumulation_fusion(model: nn.Module, enabled: bool = True) -> int:
    """Fuse each Float8Linear's weight-gradient accumulation into its wgrad GEMM (Megatron's
    ``gradient_accumulation_fusion``, Transformer Engine's ``fuse_wgrad_accumulation``): when
    ``weight.grad`` already holds a gradient (the second and later micro-batches of a
    gradient-accumulation step, or ``zero_grad(set_to_none=False)``), the GEMM adds ``dYᵀ · X``
    into it in place (cuBLASLt, ``beta = 1``) instead of returning a new FP32 tensor of the
    weight's size for autograd to add — one pass over the gradient instead of three, and no
    weight-sized temporary. The first micro-batch after ``zero_grad()`` (``set_to_none``) runs
    as before. Eager path only (a compiled model keeps its traced FP8 linears, which return the
    gradient); FP32 gradients only (master weights).

    Because the gradient is added inside the GEMM, autograd's AccumulateGrad does not run for
    the weight: hooks registered on it (DDP's and FSDP's gradient reduction,
    ``register_post_accumulate_grad_hook``) would be skipped. So it is for one process or a
    loop that reduces gradients itself; :func:`nemo_fp8_recipes.trainer.distributed.wrap_model` refuses
    a model that has it on.
    ``torch.autograd.grad`` and ``backward(inputs=...)`` without the weight are detected and get
    the usual returned gradient. Weights that are not FP32 and weights with gradient hooks
    (``register_hook``, ``register_post_accumulate_grad_hook``) are refused here and, for hooks
    added later, in backward. Returns the number of modules set. A thin wrapper,
    ``reconfigure(fuse_wgrad_accumulation=enabled)`` on each (every module is checked before any
    changes); ``convert_model(..., fuse_wgrad_accumulation=True)`` turns it on at conversion."""
    mods = fp8_modules(model).values()
    if enabled:
        for m in mods:  # (checked again in backward: hooks can be added later)
            check_wgrad_fusion(m)
    for m in mods:
        m.reconfigure(fuse_wgrad_accumulation=bool(enabled))
    return len(mods)


def set_amax_reduce_fn(model: nn.Module, fn: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Install a hook that max-reduces delayed-scaling amaxes across ranks before each scale
    update of the ``lazy`` schedule, e.g. ``lambda t: (dist.all_reduce(t, op=dist.ReduceOp.MAX),
    t)[1]``. A thin wrapper, ``reconfigure(amax_reduce_fn=fn)`` on each FP8 linear;
    ``convert_model(..., amax_reduce_fn=fn)`` installs it at conversion."""
    for m in fp8_modules(model).values():
        m.reconfigure(amax_reduce_fn=fn)
