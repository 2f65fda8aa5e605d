"""One rank of a data-parallel test: ``torchrun --nproc_per_node N tests/trainer/dist_worker.py SPEC OUT``.

SPEC is a JSON file: ``{"runs": [{"name": ..., "overrides": [...]}, ...]}``. The worker joins the
gloo group once, runs every trainer config in turn (the trainer uses the existing group), and
writes ``OUT/<name>.rank<r>.json`` with the per-step losses and every delayed-scaling buffer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist


def fp8_state(model) -> dict:
    from nemo_fp8_recipes.nn import fp8_modules, grouped_fp8_modules

    out = {}
    for name, m in (*fp8_modules(model).items(), *grouped_fp8_modules(model).items()):
        if m.recipe.is_delayed:
            out[name] = {"scale": m.fp8_scale.tolist(), "history": m.fp8_amax_history.tolist()}
    return out


def _stale(model) -> list:
    from nemo_fp8_recipes.nn import fp8_modules

    return [name for name, m in fp8_modules(model).items() if m.graph_weight_cache_stale()]


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.train import train

    rank = dist.get_rank()
    for run in spec["runs"]:
        result = train(compose_config(run["overrides"]))
        record = {
            "rank": rank,
            "world_size": result.world_size,
            "losses": [[h["step"], h["loss"]] for h in result.history],
            "grad_norms": [h["grad_norm"] for h in result.history],
            "fp8_state": fp8_state(result.model),
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
            "compiled_weight_cache": result.compiled_weight_cache,
            "stale_weight_caches": _stale(result.model),
        }
        (out / f"{run['name']}.rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
