"""Data-parallel training on CPU with the gloo backend: 2 real processes under ``torchrun``.

A 2-rank run (DDP or FSDP2, one micro-batch per rank) must reproduce a 1-rank run with the same
global batch (two micro-batches of gradient accumulation) for every recipe; delayed-scaling
state must be identical on every rank; checkpoints must resume across world sizes and wrappers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny import SMALL_MODEL

from nemo_fp8_recipes.config import compose_config
from nemo_fp8_recipes.recipes import list_recipes
from nemo_fp8_recipes.train import train
from nemo_fp8_recipes.trainer.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
STEPS, CKPT_AT = 6, 3
# every projection FP8 under every recipe (dims multiples of 128); global batch 4 = 2 micro x 2
BASE = [
    *SMALL_MODEL,
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    f"trainer.max_steps={STEPS}",
    "trainer.val_interval=0",
    "trainer.progress=false",
    "trainer.device=cpu",
    "data.max_files=40",
    "trainer.warmup_steps=2",
    f"trainer.ckpt_interval={CKPT_AT}",
    "trainer.ckpt_keep=5",
    "trainer.telemetry_interval=3",
]
FSDP_RECIPES = tuple(list_recipes())  # every recipe under FSDP2 too
# the MoE model (grouped FP8 experts, one per MoE layer) under delayed scaling: its per-expert
# amaxes are max-reduced over the ranks in the same all-reduce as the linears'
MOE = ["model=moe_tiny", "model.num_experts=4", "recipe=delayed"]
# Gradient sums over ranks are exact for 2 ranks x 1 micro-batch vs 1 rank x 2 micro-batches
# (each micro-batch back-propagates the same loss/4 in both), so DDP matches to the last bit in
# practice; FSDP2's sharded clip-norm reduction sums in another order.
RTOL = {"ddp": 1e-6, "fsdp2": 1e-4}
# FSDP2 computes the clip norm from shards (another summation order): its weights drift ~1e-7
# per step from the 1-rank run's, and small gradient amaxes of later steps inherit a few % of it
STATE_RTOL = {"ddp": 1e-6, "fsdp2": 0.1}


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _torchrun(args, cwd, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _run_workers(tmp: Path, runs) -> dict:
    spec = tmp / f"spec{len(list(tmp.glob('spec*.json')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    _torchrun([str(WORKER), str(spec), str(tmp)], cwd=tmp)
    return {r["name"]: [json.loads((tmp / f"{r['name']}.rank{k}.json").read_text()) for k in (0, 1)] for r in runs}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    cache = str(tmp / "token_cache")
    common = BASE + [f"run.root={tmp / 'runs'}", f"data.cache_dir={cache}"]
    # one-rank references first (they also build the token cache the workers share)
    ref = {}
    for recipe in list_recipes():
        res = train(compose_config(common + [f"recipe={recipe}", "run.tag=ref"]))
        ref[recipe] = res
    ref["moe_delayed"] = train(compose_config(common + MOE + ["run.tag=ref"]))
    runs = [{"name": f"ddp_{r}", "overrides": common + [f"recipe={r}", "run.tag=ddp"]} for r in list_recipes()]
    runs += [
        {
            "name": f"{mode}_moe_delayed",
            "overrides": common + MOE + [f"run.tag={mode}", f"trainer.data_parallel={mode}"],
        }
        for mode in ("ddp", "fsdp2")
    ]
    runs += [
        {"name": f"fsdp2_{r}", "overrides": common + [f"recipe={r}", "run.tag=fsdp2", "trainer.data_parallel=fsdp2"]}
        for r in FSDP_RECIPES
    ]
    # 2 ranks (FSDP2) resume a 1-rank checkpoint
    ckpt = tmp / "runs" / "llama3_tiny" / "delayed-ref" / "checkpoints" / f"step_{CKPT_AT:08d}.pt"
    runs.append(
        {
            "name": "fsdp2_resume_from_1rank",
            "overrides": common
            + ["recipe=delayed", "run.tag=fsdp2-resumed", "trainer.data_parallel=fsdp2", f"trainer.resume={ckpt}"],
        }
    )
    workers = _run_workers(tmp, runs)
    return {"tmp": tmp, "common": common, "ref": ref, "workers": workers}


def _worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(record):
    return torch.tensor([loss for _, loss in record["losses"]], dtype=torch.float64)


def _ref_losses(result):
    return torch.tensor([h["loss"] for h in result.history], dtype=torch.float64)


def _state_tensor(state: dict) -> torch.Tensor:
    return torch.tensor(
        [
            v
            for name in sorted(state)
            for k in ("scale", "history")
            for v in torch.tensor(state[name][k]).flatten().tolist()
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("recipe", list_recipes())
def test_two_ranks_ddp_equal_one_rank_with_accumulation(dist_runs, recipe):
    r0, r1 = dist_runs["workers"][f"ddp_{recipe}"]
    ref = _ref_losses(dist_runs["ref"][recipe])
    assert r0["world_size"] == 2 and len(r0["losses"]) == STEPS
    assert r0["losses"] == r1["losses"], "ranks must log the same (all-reduced) loss"
    got = _losses(r0)
    dev = ((got - ref).abs() / ref.abs()).max().item()
    print(f"\n{recipe:<11} ddp 2 ranks vs 1 rank: max rel loss dev {dev:.2e}; losses {got.tolist()}")
    assert dev <= RTOL["ddp"], (got, ref)
    assert got[-1] < got[0] - 0.5  # it trains


@pytest.mark.slow
def test_two_ranks_ddp_compiled_with_the_weight_cache(tmp_path, dist_runs):
    """DDP + torch.compile with two micro-batches per rank: the trainer turns the compiled FP8
    weight cache on (each rank quantises its own weights once per step; the buffers stay out of
    DDP's broadcast), both ranks log the same losses, they follow a one-rank compiled run with
    four micro-batches, and no cache is stale at the end."""
    common = [a for a in dist_runs["common"] if not a.startswith(("trainer.max_steps", "trainer.ckpt"))]
    args = common + [
        "recipe=tensorwise",
        "trainer.compile=true",
        "trainer.global_batch_size=8",
        "trainer.max_steps=3",
        "trainer.checkpoint=false",
        "model.num_layers=1",
    ]  # (compile time per layer)
    ref = train(compose_config(args + ["run.tag=compiled-ref"]))
    assert ref.compiled_weight_cache > 0
    r0, r1 = _run_workers(tmp_path, [{"name": "ddp_compiled", "overrides": args + ["run.tag=ddp-compiled"]}])[
        "ddp_compiled"
    ]
    assert r0["world_size"] == 2 and r0["compiled_weight_cache"] == ref.compiled_weight_cache
    assert r0["losses"] == r1["losses"], "ranks must log the same (all-reduced) loss"
    assert r0["stale_weight_caches"] == r1["stale_weight_caches"] == []
    got, want = _losses(r0), _ref_losses(ref)
    # compiled graphs split at DDP's buckets may round the non-FP8 ops differently: loose, as
    # compiled vs eager (tests/trainer/test_train.py)
    assert ((got - want).abs() / want.abs()).max().item() < 1e-2, (got, want)


@pytest.mark.parametrize("recipe", FSDP_RECIPES)
def test_two_ranks_fsdp2_equal_one_rank(dist_runs, recipe):
    r0, r1 = dist_runs["workers"][f"fsdp2_{recipe}"]
    ref = _ref_losses(dist_runs["ref"][recipe])
    assert r0["losses"] == r1["losses"]
    got = _losses(r0)
    dev = ((got - ref).abs() / ref.abs()).max().item()
    print(f"\n{recipe:<11} fsdp2 2 ranks vs 1 rank: max rel loss dev {dev:.2e}")
    assert dev <= RTOL["fsdp2"], (got, ref)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_delayed_scaling_state_identical_on_every_rank(dist_runs, mode):
    r0, r1 = dist_runs["workers"][f"{mode}_delayed"]
    assert r0["fp8_state"] and r0["fp8_state"] == r1["fp8_state"], "scales/histories differ across ranks"
    s0 = _state_tensor(r0["fp8_state"])
    ref_model = dist_runs["ref"]["delayed"].model
    ref = _state_tensor(_worker().fp8_state(ref_model))
    # the amax max-reduced over ranks equals the max over the 1-rank run's micro-batches (DDP:
    # bit for bit; FSDP2: its trajectory differs by ~1e-5, which the amaxes inherit)
    nz = ref != 0
    assert torch.equal(nz, s0 != 0)
    dev = ((s0 - ref).abs()[nz] / ref.abs()[nz]).max().item()
    print(f"\ndelayed {mode}: scales/histories on 2 ranks vs 1 rank, max rel dev {dev:.2e}")
    assert dev <= STATE_RTOL[mode]
    hist = torch.tensor(next(iter(r0["fp8_state"].values()))["history"])
    assert (hist[:, :STEPS] > 0).all() and (hist[:, STEPS:] == 0).all(), "one history entry per step"


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_grouped_moe_experts_on_two_ranks_equal_one_rank(dist_runs, mode):
    """moe_tiny's grouped FP8 experts under delayed scaling: every expert's scales and histories
    are the same on both ranks; under DDP the 2 ranks follow the 1-rank run with accumulation and
    their scaling state equals its (the max over ranks is the max over micro-batches). FSDP2's
    drift (another summation order) is amplified by the router, where a token near a tie can
    change experts: its losses are compared loosely and its state only across ranks."""
    r0, r1 = dist_runs["workers"][f"{mode}_moe_delayed"]
    ref = dist_runs["ref"]["moe_delayed"]
    assert r0["losses"] == r1["losses"]
    got, want = _losses(r0), _ref_losses(ref)
    assert ((got - want).abs() / want.abs()).max().item() <= {"ddp": RTOL["ddp"], "fsdp2": 2e-3}[mode], (got, want)
    experts = "layers.1.feed_forward.experts"
    assert experts in r0["fp8_state"] and r0["fp8_state"] == r1["fp8_state"]
    if mode == "fsdp2":
        return
    s0, s_ref = _state_tensor(r0["fp8_state"]), _state_tensor(_worker().fp8_state(ref.model))
    nz = s_ref != 0
    assert torch.equal(nz, s0 != 0)
    assert ((s0 - s_ref).abs()[nz] / s_ref.abs()[nz]).max().item() <= STATE_RTOL["ddp"]


def test_checkpoint_from_two_ranks_resumes_on_one(dist_runs):
    """A 2-rank DDP checkpoint (and an FSDP2 one) resumed by a 1-rank run continues the 1-rank
    curve; a 1-rank checkpoint resumed by 2 FSDP2 ranks does too."""
    tmp, common = dist_runs["tmp"], dist_runs["common"]
    ref = _ref_losses(dist_runs["ref"]["delayed"])[CKPT_AT:]
    for mode in ("ddp", "fsdp2"):
        ckpt = tmp / "runs" / "llama3_tiny" / f"delayed-{mode}" / "checkpoints" / f"step_{CKPT_AT:08d}.pt"
        state = load_checkpoint(ckpt, map_location="cpu")
        assert state["world_size"] == 2 and state["data_parallel"] == mode
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
        res = train(compose_config(common + ["recipe=delayed", f"run.tag={mode}-to-1", f"trainer.resume={ckpt}"]))
        assert res.start_step == CKPT_AT and res.world_size == 1
        got = _ref_losses(res)
        dev = ((got - ref).abs() / ref.abs()).max().item()
        print(f"\n{mode} 2-rank checkpoint resumed on 1 rank: max rel loss dev {dev:.2e}")
        assert dev <= RTOL["fsdp2"], (got, ref)
    r0, _ = dist_runs["workers"]["fsdp2_resume_from_1rank"]
    got = _losses(r0)
    assert [s for s, _ in r0["losses"]] == list(range(CKPT_AT + 1, STEPS + 1))
    assert ((got - ref).abs() / ref.abs()).max().item() <= RTOL["fsdp2"]


def test_rank0_writes_merged_audit_and_telemetry(dist_runs):
    run_dir = dist_runs["tmp"] / "runs" / "llama3_tiny" / "blockwise-fsdp2"
    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["ranks"] == {"world_size": 2, "problems": []}
    assert (
        "2 data-parallel ranks (fsdp2): every rank ran the same precision per module"
        in (run_dir / "audit.txt").read_text()
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["data_parallel"] == "fsdp2"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1, "only rank 0 writes TensorBoard events"
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("fp8/mlp/input/amax")] == [3, 6]


def test_torchrun_cli_and_batch_divisibility(tmp_path, dist_runs):
    """The documented command: ``torchrun --nproc_per_node 2 -m nemo_fp8_recipes.train ...``."""
    common = dist_runs["common"]
    root = tmp_path / "cli"
    args = [a for a in common if not a.startswith("run.root=")] + [
        f"run.root={root}",
        "recipe=tensorwise",
        "trainer.max_steps=2",
    ]
    _torchrun(["-m", "nemo_fp8_recipes.train", *args], cwd=tmp_path)
    summary = json.loads((root / "llama3_tiny" / "tensorwise" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    # a global batch that 2 ranks cannot split is refused with the fix in the message
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "nemo_fp8_recipes.train",
        *args,
        "trainer.global_batch_size=2",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "must be a multiple of trainer.micro_batch_size (2) x 2 data-parallel ranks" in proc.stderr


def test_scaling_benchmark_smoke(tmp_path):
    """benchmarks/train_throughput.py --nproc 1,2: one process vs two (gloo on CPU), one table."""
    out = tmp_path / "dp.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "train_throughput.py"),
        "--smoke",
        "--recipes",
        "delayed",
        "--nproc",
        "1,2",
        "--root",
        str(tmp_path / "runs"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["nproc"] for r in results] == [1, 2]
    two = results[1]
    assert two["scaling_efficiency"] > 0
    assert two["max_rel_loss_dev_vs_1proc"] == 0.0  # deterministic CPU kernels: identical curves
    assert "| DP efficiency |" in proc.stdout


def _reduce_telemetry_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from nemo_fp8_recipes.trainer.distributed import DistContext, reduce_telemetry

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        values = {
            "fp8/experts/input/amax": [3.0, 5.0][rank],
            "fp8/experts/input/underflow_frac_worst": [0.25, 0.5][rank],
            "fp8/experts/input/sqnr_db_worst": [30.0, 20.0][rank],
            "fp8/experts/input/sqnr_db": [40.0, 30.0][rank],
        }
        got = reduce_telemetry(values, DistContext(world_size=2, rank=rank))
        Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_telemetry_of_two_ranks_combines_each_statistic_as_over_modules(tmp_path):
    """Two gloo ranks: amax and the worst expert's fractions take the max over ranks, the worst
    expert's SQNR the min, every other statistic the mean — the rule collect_telemetry applies
    over modules (nn.telemetry_combine)."""
    import socket

    import torch.multiprocessing as mp

    from nemo_fp8_recipes.nn import telemetry_combine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce_telemetry_worker, args=(port, str(tmp_path / "t")), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"t.{r}.json").read_text()) for r in (0, 1))
    assert (
        r0
        == r1
        == {
            "fp8/experts/input/amax": 5.0,
            "fp8/experts/input/underflow_frac_worst": 0.5,
            "fp8/experts/input/sqnr_db_worst": 20.0,
            "fp8/experts/input/sqnr_db": 35.0,
        }
    )
    assert [telemetry_combine(k) for k in ("amax", "fp8/a/b/sqnr_db_worst", "scale")] == ["max", "min", "mean"]
