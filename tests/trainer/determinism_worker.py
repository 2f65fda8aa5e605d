"""Train every config of a JSON spec in this process and write what each run computed, bit for
bit: every step's loss and gradient norm, every validation loss (floats, which JSON writes and
reads back exactly) and a SHA-256 of the final parameters. tests/trainer/test_determinism.py runs it twice,
in two processes, and compares the files.

    python tests/trainer/determinism_worker.py SPEC.json OUT.json RUN_ROOT

SPEC: ``{"name": [Hydra overrides, ...], ...}``; each run writes under ``RUN_ROOT/<name>``.
"""

from __future__ import annotations

import hashlib
import json
import sys


def _param_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if hasattr(p, "detach") and p.is_floating_point():
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(spec_path: str, out_path: str, root: str) -> int:
    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.train import train

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    out = {}
    for name, overrides in spec.items():
        r = train(compose_config([*overrides, f"run.root={root}/{name}"]))
        out[name] = {
            "loss": [h["loss"] for h in r.history],
            "grad_norm": [h["grad_norm"] for h in r.history],
            "val": [v for _, v in r.val],
            "params": _param_digest(r.model),
            "cuda_graph_skips": r.cuda_graph_skips,
        }
        print(f"{name}: {len(r.history)} steps, final loss {r.history[-1]['loss']:.6f}", flush=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
