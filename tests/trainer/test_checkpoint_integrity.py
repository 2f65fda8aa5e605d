"""Checkpoints that are damaged, cut short, or interrupted: nothing is lost and nothing corrupt
loads silently.

- A checkpoint carries checksums of its own content; flipped bytes inside the optimizer state, a
  truncated and an empty file are refused, and the error names the newest older checkpoint that
  loads (the run is not resumed from it behind the user's back).
- A full disk during a save says so and keeps the older checkpoints.
- Kill points: the trainer is killed with SIGKILL at random moments while it writes checkpoints,
  over and over, and resumed each time: every checkpoint on disk verifies, none is lost, and the
  run ends with exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.tiny import SMALL_MODEL

from nemo_fp8_recipes.config import compose_config
from nemo_fp8_recipes.train import main, train
from nemo_fp8_recipes.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    save_checkpoint,
    state_checksums,
)

TINY = [
    *SMALL_MODEL,
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=4",
    "trainer.warmup_steps=2",
    "trainer.val_interval=0",
    "trainer.progress=false",
    "trainer.device=cpu",
    "data.max_files=40",
    "trainer.log_interval=1",
]


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def _cfg(root: Path, token_cache, *extra):
    return compose_config(TINY + [f"run.root={root}", f"data.cache_dir={token_cache}", *extra])


@pytest.fixture
def two_checkpoints(tmp_path, token_cache):
    """A delayed-scaling run with checkpoints at steps 2 and 4."""
    result = train(
        _cfg(
            tmp_path / "runs",
            token_cache,
            "recipe=delayed",
            "trainer.max_steps=4",
            "trainer.ckpt_interval=2",
            "trainer.ckpt_keep=5",
        )
    )
    mgr = CheckpointManager(result.run_dir / "checkpoints")
    assert [p.name for p in mgr.list()] == ["step_00000002.pt", "step_00000004.pt"]
    return result, mgr


def _flip_inside(path: Path, tensor: torch.Tensor, n: int = 64) -> None:
    """Flip ``n`` bytes in the middle of ``tensor``'s bytes as stored in ``path``."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes should appear once in the file"
    mid = at + len(raw) // 2 - n // 2
    for i in range(mid, mid + n):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _resume_error(tmp_path, token_cache, *extra) -> str:
    with pytest.raises(CheckpointError) as info:
        train(
            _cfg(
                tmp_path / "runs",
                token_cache,
                "recipe=delayed",
                "trainer.max_steps=6",
                "trainer.ckpt_interval=2",
                "trainer.ckpt_keep=5",
                *extra,
            )
        )
    return str(info.value)


def test_flipped_bytes_in_the_optimizer_state_are_refused_naming_the_good_one(two_checkpoints, tmp_path, token_cache):
    result, mgr = two_checkpoints
    bad, good = mgr.path_for(4), mgr.path_for(2)
    state = load_checkpoint(bad)
    exp_avg = next(iter(state["optimizer"]["state"].values()))["exp_avg"]
    assert exp_avg.numel() * exp_avg.element_size() >= 256
    _flip_inside(bad, exp_avg)
    # torch.load alone reads it without a word: the damage is only visible to the checksums
    torch.load(bad, weights_only=True)
    with pytest.raises(CheckpointError, match=r"step_00000004\.pt is corrupt: 1 entry does not match.*exp_avg"):
        load_checkpoint(bad)
    msg = _resume_error(tmp_path, token_cache)
    assert "corrupt" in msg and "exp_avg" in msg and str(good) in msg and f"trainer.resume={good}" in msg
    assert bad.is_file()  # refused, not deleted: the user decides

    # resuming from the named checkpoint works; the bad later one is kept aside, not resumed again
    cont = train(
        _cfg(
            tmp_path / "runs",
            token_cache,
            "recipe=delayed",
            "trainer.max_steps=6",
            "trainer.ckpt_interval=2",
            "trainer.ckpt_keep=5",
            f"trainer.resume={good}",
        )
    )
    assert cont.start_step == 2 and cont.final_step == 6
    assert list(bad.parent.glob("step_00000004.pt.superseded-*"))
    for p in mgr.list():
        load_checkpoint(p)  # every listed checkpoint verifies


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_truncated_and_empty_checkpoints_name_the_older_one_that_loads(two_checkpoints, tmp_path, token_cache, damage):
    _, mgr = two_checkpoints
    bad, good = mgr.path_for(4), mgr.path_for(2)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    msg = _resume_error(tmp_path, token_cache)
    assert ("empty (0 bytes)" if damage == "empty" else "truncated or corrupt") in msg
    assert f"trainer.resume={good}" in msg
    # both damaged: no older checkpoint loads either
    good.write_bytes(b"")
    msg = _resume_error(tmp_path, token_cache)
    assert "No older checkpoint of that directory loads either" in msg


@pytest.mark.parametrize("missing", ["scheduler", "rng", "optimizer"])
def test_a_checkpoint_missing_a_part_names_the_older_one_that_resumes(two_checkpoints, tmp_path, token_cache, missing):
    """A checkpoint that verifies but lacks a part a resume restores is a checkpoint error naming
    the part and the older checkpoint that resumes (not a KeyError)."""
    _, mgr = two_checkpoints
    bad, good = mgr.path_for(4), mgr.path_for(2)
    state = load_checkpoint(bad)
    del state[missing]
    save_checkpoint(state, bad)  # fresh checksums: only the missing part is wrong
    msg = _resume_error(tmp_path, token_cache)
    assert f"the checkpoint has no {missing}" in msg and f"trainer.resume={good}" in msg, msg


def test_a_checkpoint_of_a_newer_format_says_to_upgrade(two_checkpoints, tmp_path, token_cache):
    from nemo_fp8_recipes.trainer.checkpoint import CHECKPOINT_FORMAT

    _, mgr = two_checkpoints
    for p in mgr.list():
        state = load_checkpoint(p)
        state["format"] = CHECKPOINT_FORMAT + 1
        save_checkpoint(state, p)
    msg = _resume_error(tmp_path, token_cache)
    assert f"format {CHECKPOINT_FORMAT + 1} is newer than this version" in msg and "pip install -U" in msg, msg
    assert "No older checkpoint of that directory loads either" in msg


def test_the_nan_error_names_a_checkpoint_that_verifies(tmp_path, token_cache):
    nan = [
        "recipe=bf16",
        "trainer.lr=1e30",
        "trainer.min_lr=1e30",
        "trainer.warmup_steps=0",
        "trainer.grad_clip=0",
        "trainer.max_steps=6",
        "trainer.ckpt_interval=1",
    ]
    from nemo_fp8_recipes.trainer import NonFiniteLossError

    with pytest.raises(NonFiniteLossError) as info:
        train(_cfg(tmp_path / "runs", token_cache, *nan))
    load_checkpoint(info.value.last_checkpoint)  # "last good" is a checkpoint that loads and verifies


def test_checksums_cover_every_tensor_and_value():
    state = {
        "step": 3,
        "model": {"w": torch.arange(6.0).reshape(2, 3), "s": torch.tensor(1.5)},
        "rng": [torch.zeros(4, dtype=torch.uint8), 7],
        "bf": torch.ones(3, dtype=torch.bfloat16),
    }
    c = state_checksums(state)
    assert set(c["tensors"]) == {"model.w", "model.s", "rng[0]", "bf"}
    assert c["tensors"]["model.w"].endswith("float32 [2, 3]")
    changed = {**state, "step": 4}
    assert state_checksums(changed)["values"] != c["values"]
    w = state["model"]["w"].clone()
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(100.0))
    assert (
        state_checksums({**state, "model": {**state["model"], "w": w}})["tensors"]["model.w"] != c["tensors"]["model.w"]
    )


def test_a_checkpoint_without_checksums_loads_with_a_warning(tmp_path, caplog):
    p = tmp_path / "step_00000001.pt"
    torch.save({"step": 1, "w": torch.ones(2)}, p)  # as written before checksums existed
    with caplog.at_level("WARNING"):
        assert load_checkpoint(p)["step"] == 1
    assert "no checksums" in caplog.text


def _mount_tmpfs(where: Path, size: str):
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"a small tmpfs (the full disk of this test) cannot be mounted here: {proc.stderr.strip()}")


def test_a_full_disk_says_so_and_keeps_the_older_checkpoints(tmp_path, token_cache, capsys):
    # the size of one checkpoint of this run, measured
    probe = train(_cfg(tmp_path / "probe", token_cache, "recipe=tensorwise", "trainer.max_steps=1"))
    size = probe.checkpoint.stat().st_size
    disk = tmp_path / "small_disk"
    _mount_tmpfs(disk, str(int(2.6 * size) + 256 * 1024))  # room for two checkpoints and the logs
    capsys.readouterr()  # what earlier in-process runs left on the captured streams
    try:
        code = main(
            TINY
            + [
                f"run.root={disk}",
                f"data.cache_dir={token_cache}",
                "recipe=tensorwise",
                "trainer.max_steps=6",
                "trainer.ckpt_interval=1",
                "trainer.ckpt_keep=6",
            ]
        )
        err = capsys.readouterr().err
        assert code == 4, err
        assert "disk full while writing checkpoint" in err and "Traceback" not in err
        assert "trainer.checkpoint=false" in err and "older checkpoints there are intact" in err
        mgr = CheckpointManager(disk / "llama3_tiny" / "tensorwise" / "checkpoints")
        kept = mgr.list()
        assert kept and not [p for p in mgr.directory.iterdir() if p.name.startswith(".tmp-")]
        for p in kept:
            load_checkpoint(p)
    finally:
        # lazily: this process may still hold a log file there (Hydra's job log of the in-process run)
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---- kill -9 while checkpoints are written ----------------------------------------------------------
KILL_RUN = [
    "model.num_layers=2",
    "model.dim=512",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_dim=1024",
    "trainer.seq_len=32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=2",
    "trainer.warmup_steps=2",
    "trainer.val_interval=0",
    "trainer.progress=false",
    "trainer.device=cpu",
    "data.max_files=20",
    "trainer.log_interval=1",
    "trainer.telemetry_interval=0",
    "recipe=delayed",
    "trainer.max_steps=30",
    "trainer.ckpt_interval=1",
    "trainer.ckpt_keep=2",
]


def _verify_all(mgr: CheckpointManager):
    steps = []
    for p in mgr.list():
        state = load_checkpoint(p)  # raises if anything on disk is corrupt
        assert state["step"] == mgr.step_of(p)
        steps.append(state["step"])
    return steps


# A process that imports torch and the trainer once and then forks one training run per request, so
# each kill point costs a training start, not a Python + torch start. It computes nothing itself
# before forking (fork-safe: no thread pool exists yet). Protocol on stdin/stdout: "go" -> the child's
# pid; when the child is gone, its exit code (-9 after a kill -9).
_ZYGOTE = r"""
import os, sys
import torch  # noqa: F401
from nemo_fp8_recipes.train import train
from nemo_fp8_recipes.config import compose_config
args = sys.argv[1:]
for line in sys.stdin:
    if line.strip() != "go":
        break
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the protocol owns stdout
        code = 0
        try:
            train(compose_config(args))
        except BaseException:
            code = 1
        os._exit(code)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.slow
def test_kill_9_at_random_points_of_checkpoint_writes_loses_nothing(tmp_path, token_cache):
    import select

    rng = random.Random(20261201)
    root = tmp_path / "killed"
    args = KILL_RUN + [f"run.root={root}", f"data.cache_dir={token_cache}"]
    ckpt_dir = root / "llama3_tiny" / "delayed" / "checkpoints"
    mgr = CheckpointManager(ckpt_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )

    def writing(pid: int) -> bool:  # this process has a checkpoint's temporary file open
        return ckpt_dir.is_dir() and any(
            e.name.startswith(".tmp-") and f".{pid}." in e.name for e in os.scandir(ckpt_dir)
        )

    def exited() -> bool:  # the zygote reported the child's exit code
        return bool(select.select([zygote.stdout], [], [], 0)[0])

    kills, mid_write, latest, finished = 0, 0, 0, False
    try:
        for _ in range(60):
            if kills >= 15:
                break
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            # let it write one to three checkpoints, then kill it at a random moment after a write began
            target, seen, killed = rng.randint(1, 3), 0, False
            deadline = time.monotonic() + 180
            while not exited() and time.monotonic() < deadline:
                if writing(pid):
                    seen += 1
                    if seen >= target:
                        time.sleep(rng.uniform(0.0, 0.03))
                        mid_write += writing(pid)
                        os.kill(pid, signal.SIGKILL)
                        killed = True
                        break
                    while writing(pid) and not exited():
                        time.sleep(0.0005)
                time.sleep(0.0005)
            code = int(zygote.stdout.readline())
            if not killed:
                assert code == 0, f"the training run failed (exit {code})"
                finished = True
                break
            assert code == -signal.SIGKILL
            kills += 1
            steps = _verify_all(mgr)  # 0 silently corrupt
            assert steps or not latest, f"checkpoint of step {latest} lost"  # 0 lost
            assert not steps or steps[-1] >= latest, f"checkpoint of step {latest} lost"
            latest = steps[-1] if steps else latest
        assert kills >= 15, f"only {kills} kill points"
        assert mid_write >= 5, f"only {mid_write} of {kills} kills landed inside a write"
        if not finished:  # finish the run (resume=auto)
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            zygote.stdout.readline()
            assert int(zygote.stdout.readline()) == 0
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    # the run that was never interrupted, in this process
    clean_root = tmp_path / "clean"
    uninterrupted = [a for a in KILL_RUN if not a.startswith("trainer.ckpt_interval=")] + ["trainer.ckpt_interval=0"]
    # one thread, as the killed runs (OMP_NUM_THREADS=1): at this width the thread count changes
    # the last bits of the CPU GEMMs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(compose_config(uninterrupted + [f"run.root={clean_root}", f"data.cache_dir={token_cache}"]))
    finally:
        torch.set_num_threads(threads)
    a = load_checkpoint(mgr.path_for(30))
    b = load_checkpoint(CheckpointManager(clean_root / "llama3_tiny" / "delayed" / "checkpoints").path_for(30))
    for k, t in b["model"].items():
        assert torch.equal(a["model"][k], t), k  # bit-exact resume through every kill
    print(f"kill points: {kills}, inside a write: {mid_write}")


def test_a_full_disk_while_tensorboard_writes_stops_the_run_with_the_reason(tmp_path, token_cache, capsys):
    """The run directory's file system fills while the events are written (checkpointing off, so
    only TensorBoard writes): the run stops with one line naming the directory and the fix, no
    traceback from the writer's thread."""
    root = tmp_path / "small"
    _mount_tmpfs(root, "48k")
    try:
        rc = main(
            TINY
            + [
                f"run.root={root}",
                f"data.cache_dir={token_cache}",
                "recipe=tensorwise",
                "trainer.max_steps=5000",
                "trainer.log_interval=1",
                "trainer.val_interval=0",
                "trainer.checkpoint=false",
            ]
        )
        err = capsys.readouterr().err
        assert rc == 5, err[-3000:]
        assert "cannot write the TensorBoard events in" in err and "No space left on device" in err, err[-3000:]
        assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    finally:
        subprocess.run(["umount", str(root)], capture_output=True)
