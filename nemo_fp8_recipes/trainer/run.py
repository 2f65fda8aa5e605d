"""The embedded trainer's run: :class:`Trainer` (setup, step, evaluate, checkpoint, log, finish)
and :func:`train` (``Trainer(cfg).run()``); the command line is :mod:`.cli`.

Reading order: ``setup`` checks the config (:mod:`.checks`) and builds device, data, model,
optimizer and the resumed state; ``run`` loops over ``step`` (one optimizer step with gradient
accumulation), then logs (:mod:`.logs`), validates and checkpoints (:mod:`.checkpoint`) when due;
``finish`` writes the summary (:class:`~.result.TrainResult`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..config import (
    build_kernel_options,
    build_policy,
    build_recipe,
    resolve_device,
)
from ..data import ByteTokenizer, PackedTokens, TrainBatches, ValBatches, load_corpus
from ..determinism import deterministic_mode, explain_nondeterministic_op
from ..models import Transformer
from .backends import Backend, make_backend
from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointManager,
    capture_rng_state,
    check_compatible,
    load_for_resume,
    load_model_state,
    resolve_resume,
    restore_rng_state,
)
from .checks import (
    check_batch_split,
    check_compile_mode,
    check_cpu_compile,
    check_embedded_run,
    check_memory,
    model_and_data_configs,
)
from .compile import compile_model
from .distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    dist_world_size,
    full_tensor,
    grad_sync,
    init_distributed,
    reduce_telemetry,
    state_dicts,
    wrap_model,
)
from .lock import run_dir_lock
from .logs import (
    LogWindow,
    MetricsWriter,
    format_count,
    format_duration,
    peak_tflops,
    record_audit,
)
from .optim import apply_hyperparameters, build_optimizer
from .result import NonFiniteLossError, StepStats, Terminated, TrainingError, TrainResult

__all__ = ["Trainer", "train"]

log = logging.getLogger("nemo_fp8_recipes.train")


# ---- building blocks -----------------------------------------------------------------------
def _seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the model initialisation)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _autocast(device: torch.device, mode: str):
    """``(context factory, whether BF16)`` for the non-FP8 ops: BF16 autocast for
    ``trainer.autocast=bf16``, or ``auto`` on CUDA; otherwise a no-op context."""
    use_bf16 = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext, False
    return (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)), True


# ---- the run -------------------------------------------------------------------------------
class Trainer:
    """One run of the embedded trainer: ``Trainer(cfg).run()`` returns a :class:`TrainResult`.

    :meth:`setup` checks the config and builds the run: device and process group (``ctx``),
    data (``train_batches``, ``val_batches``), the model and its FP8 conversion, the optimizer,
    the resumed state (:meth:`resume`) and the logs. :meth:`run` then repeats :meth:`step` (one
    optimizer step) and what follows it (:meth:`log_step`, :meth:`evaluate`, :meth:`checkpoint`)
    up to ``trainer.max_steps``, and :meth:`finish` writes ``summary.json``. :meth:`close` ends the
    process group :meth:`setup` started. :func:`train` does all of it.

    The model has three names: ``raw_model`` (the module itself, which the FP8 helpers and the
    audit walk), ``dp_model`` (wrapped for data parallelism: DDP / FSDP2, or ``raw_model`` in one
    process; its parameters are clipped and checkpointed) and ``model`` (``dp_model`` under
    ``torch.compile`` if ``trainer.compile``: what runs forward).
    """

    def __init__(self, cfg, backend: Optional[Backend] = None) -> None:
        self.cfg = cfg  #: the composed config (``DictConfig``); setup records the kernel options in it
        #: who computes the FP8 GEMMs (:class:`~.backends.Backend`); None: the ``backend`` config group's
        self.backend = backend
        self.ctx: Optional[DistContext] = None
        self.result: Optional[TrainResult] = None
        #: trainer.deterministic's switches and the run directory's lock, undone by close()
        self._process_settings = contextlib.ExitStack()

    # ---- set-up ----
    def setup(self) -> None:
        """Check the config, then build the run: device and process group, data, model,
        optimizer, resumed state, logs."""
        self.t_start = time.perf_counter()
        self._configure()
        self.run_dir = Path(self.rcfg.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.ctx.is_main:  # one trainer per run directory, released by close()
            self._process_settings.enter_context(run_dir_lock(self.run_dir))
        self.ckpt_mgr = CheckpointManager(self.run_dir / "checkpoints", keep=self.tcfg.ckpt_keep)
        self.resume_path = resolve_resume(self.tcfg, self.ckpt_mgr)
        self._build_data()
        self._build_model()
        self.optimizer, self.scheduler = build_optimizer(self.dp_model, self.tcfg, self.device)
        self.resume()
        self._open_logs()
        self.global_step = self.start_step  #: optimizer steps completed
        self.tokens_per_step = self.tcfg.global_batch_size * self.tcfg.seq_len
        self.telemetry_on = self.recipe.is_fp8 and self.tcfg.telemetry_interval > 0
        self.telemetry_due = False  # FP8 telemetry is collected in the current step
        self.mid_step = False  # weights, counters and FP8 state may disagree (not a state to save)
        self.step_time_total, self.steps_timed = 0.0, 0

    def _configure(self) -> None:
        """Validate the config and resolve what the run runs with: recipe, policy, kernel
        options, device and process group, model and data configs. Everything that can fail
        before any work fails here (the checks are in :mod:`nemo_fp8_recipes.trainer.checks`)."""
        from omegaconf import open_dict

        cfg = self.cfg
        self.tcfg, self.rcfg, backend_name = check_embedded_run(cfg)
        tcfg = self.tcfg
        if self.backend is None:
            self.backend = make_backend(backend_name, cfg.backend, telemetry=tcfg.telemetry_interval > 0)
        # before anything imports Transformer Engine or runs a kernel (process-wide; close() restores)
        self.determinism = self._process_settings.enter_context(
            deterministic_mode(tcfg.deterministic, transformer_engine=self.backend.uses_transformer_engine)
        )
        device = resolve_device(tcfg.device)
        self.recipe = build_recipe(cfg.recipe)
        self.policy = build_policy(cfg.get("policy"))
        self.kernel_options = build_kernel_options(cfg.get("kernels"))
        with open_dict(cfg):  # the values it runs with (null = default) go into config.yaml
            cfg.kernels = self.kernel_options.as_dict()
        self.backend.check(self.recipe, device, tcfg)
        check_batch_split(tcfg, dist_world_size())
        self.ctx = ctx = init_distributed(device)
        if ctx.is_main:
            for warning in self.recipe.numerics_warnings():
                log.warning(warning)
        self.device = ctx.device
        self.accum = tcfg.grad_accum // ctx.world_size  # micro-batches per rank per step
        if not ctx.is_main:
            log.setLevel(logging.WARNING)
        self.autocast, self.bf16 = _autocast(self.device, tcfg.autocast)  # (factory, whether BF16)
        self.tokenizer = ByteTokenizer()
        self.mcfg, self.dcfg = model_and_data_configs(cfg, tcfg, self.tokenizer.vocab_size)
        self.backend.check_model(self.mcfg, self.recipe, self.policy)
        check_memory(tcfg, self.mcfg, self.recipe, self.device, world_size=ctx.world_size, bf16_activations=self.bf16)
        check_cpu_compile(tcfg, self.recipe, self.device)
        check_compile_mode(tcfg, self.device, world_size=ctx.world_size)

    def _build_data(self) -> None:
        """The tokenised corpus, the training micro-batches (a pure function of seed and step) and
        the fixed validation set (None without validation)."""
        tcfg = self.tcfg
        self.corpus = load_corpus(self.dcfg, self.tokenizer)
        self.train_batches = TrainBatches(
            PackedTokens(self.corpus.train, tcfg.seq_len, "train"),
            seed=tcfg.seed,
            micro_batch_size=tcfg.micro_batch_size,
            grad_accum=tcfg.grad_accum,
        )
        self.val_batches = None
        if tcfg.val_interval > 0 and tcfg.val_steps > 0:
            self.val_batches = ValBatches(
                PackedTokens(self.corpus.val, tcfg.seq_len, "validation"),
                micro_batch_size=tcfg.micro_batch_size,
                num_batches=tcfg.val_steps,
            )

    def _build_model(self) -> None:
        """The seeded model on the device, converted to the recipe by the backend (our FP8 linears,
        or TE's with backend=te) with the per-step FP8 options, then wrapped for data parallelism."""
        tcfg, ctx = self.tcfg, self.ctx
        _seed_everything(tcfg.seed)
        with torch.device(self.device):
            raw_model = Transformer(self.mcfg)
        self.backend.convert(
            raw_model,
            recipe=self.recipe,
            policy=self.policy,
            options=self.kernel_options,
            ctx=ctx,
            tcfg=tcfg,
            accum=self.accum,
        )
        if self.device.type == "cuda" and ctx.is_main:
            self._hint_small_gemms(raw_model)
        self.raw_model = raw_model
        self.dp_model = wrap_model(raw_model, tcfg.data_parallel, ctx)

    def _hint_small_gemms(self, raw_model: torch.nn.Module) -> None:
        """Warn when every FP8 GEMM is below the recipe's measured FP8/BF16 crossover (GPU runs)."""
        from ..policy import linear_shape, small_gemm_hint

        shapes = [shape for shape in map(linear_shape, self.backend.fp8_gemm_modules(raw_model)) if shape is not None]
        hint = small_gemm_hint(self.recipe, self.policy, shapes)
        if hint:
            log.warning(hint)

    def resume(self) -> None:
        """Start from step 0, or restore the checkpoint ``resume_path`` names after its checks
        (:func:`~nemo_fp8_recipes.checkpoint.check_compatible`): model and FP8 state, optimizer,
        scheduler, RNG, counters and the open logging window; the current hyperparameters win."""
        self.start_step, self.tokens_seen, self.skipped = 0, 0, 0
        self.last_ckpt: Optional[Path] = None
        self.window = LogWindow()
        path, tcfg, optimizer = self.resume_path, self.tcfg, self.optimizer
        if path is None:
            return
        ckpt = load_for_resume(path, tcfg)
        forced = check_compatible(
            ckpt,
            path,
            self.recipe,
            self.mcfg,
            tcfg,
            self.corpus.fingerprint,
            auto=tcfg.resume == "auto",
            backend=self.backend.name,
            settings=self.resume_settings(),
        )
        load_model_state(self.dp_model, optimizer, ckpt["model"], ckpt["optimizer"], forced)
        self.scheduler.load_state_dict(ckpt["scheduler"])
        apply_hyperparameters(optimizer, self.scheduler, tcfg, int(ckpt["step"]))  # the current config's
        restore_rng_state(ckpt["rng"])
        self.start_step = int(ckpt["step"])
        self.tokens_seen = int(ckpt.get("tokens_seen", 0))
        self.skipped = int(ckpt.get("skipped_steps", 0))
        self.window = LogWindow.resumed(ckpt.get("log_window"))  # the window the checkpoint was written in
        self.last_ckpt = path
        if self.ctx.is_main and path.parent.resolve() == self.ckpt_mgr.directory.resolve():
            for q in self.ckpt_mgr.supersede_after(self.start_step):
                log.warning(
                    "resumed from step %d: the later checkpoint %s is kept as %s and no longer resumed from",
                    self.start_step,
                    q.name.split(".superseded-")[0],
                    q.name,
                )
        log.info("resumed from %s at step %d", path, self.start_step)

    def _open_logs(self) -> None:
        """``config.yaml`` (rank 0), the TensorBoard writer, the run's first log line, the
        (compiled) model that runs forward, and the result to fill."""
        from omegaconf import OmegaConf

        from ..hardware import describe_device
        from ..recipes import uses_real_fp8_gemm

        cfg, tcfg, ctx = self.cfg, self.tcfg, self.ctx
        real_fp8 = self.recipe.is_fp8 and uses_real_fp8_gemm(self.recipe, self.device)
        self.mode = "no FP8" if not self.recipe.is_fp8 else ("real FP8 GEMMs" if real_fp8 else "emulated FP8")
        self.n_params = self.raw_model.num_params()
        self.flops_per_token = self.mcfg.flops_per_token(tcfg.seq_len)
        peak = peak_tflops(self.device, "fp8" if real_fp8 else "bf16")
        self.peak = peak * ctx.world_size if peak else peak
        # written only once the resume checks passed, so a refused run cannot overwrite the config
        # that produced the checkpoints in this directory
        if ctx.is_main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
            if self.start_step == 0 and (self.run_dir / "summary.json").is_file():
                # an earlier run's summary would describe this one until it finishes
                (self.run_dir / "summary.json").unlink()

        # (self.graphs: trainer.compile_mode=reduce-overhead / max-autotune replays them as CUDA graphs)
        self.model, self.graphs = compile_model(self.dp_model, self.raw_model, tcfg)
        self.writer = MetricsWriter(
            self.run_dir,
            enabled=self.rcfg.tensorboard and ctx.is_main,
            # from the first step this run logs: a resumed run replaces what the interrupted one
            # logged after its checkpoint, a fresh start everything an earlier run left here
            purge_step=self.start_step + 1,
        )
        log.info(
            "run %s | model %s (%s params, %d layers) | recipe %s (%s) | device %s | autocast %s | "
            "data %s: %s train / %s val tokens (sha256 %s) | %d steps x %d seq x %d tokens (grad accum %d%s)",
            self.run_dir,
            self.mcfg.name,
            format_count(self.n_params),
            self.mcfg.num_layers,
            self.recipe.name,
            self.mode,
            describe_device(self.device),
            "bf16" if self.bf16 else "off",
            self.dcfg.name,
            format_count(len(self.corpus.train)),
            format_count(len(self.corpus.val)),
            self.corpus.tokens_sha256[:12],
            tcfg.max_steps,
            tcfg.global_batch_size,
            tcfg.seq_len,
            self.accum,
            f" per rank, {ctx.world_size} ranks, {tcfg.data_parallel}" if ctx.distributed else "",
        )
        if tcfg.deterministic:
            log.info(
                "deterministic: on (%s): the same config and seed repeat this run bit for bit",
                ", ".join(f"{k}={v}" for k, v in self.determinism.items()),
            )
        if self.start_step == 0:
            self.writer.text("config", OmegaConf.to_yaml(cfg, resolve=True))
        self.result = TrainResult(
            run_dir=self.run_dir,
            start_step=self.start_step,
            final_step=self.start_step,
            skipped_steps=self.skipped,
            checkpoint=self.last_ckpt,
            world_size=ctx.world_size,
            model=self.raw_model,
            compiled_weight_cache=self.backend.cached_weights,
        )

    # ---- the loop ----
    def run(self) -> TrainResult:
        """Train from the start (or resumed) step to ``trainer.max_steps`` and return what the run
        did; :meth:`setup` runs first unless it already has. Ctrl-C saves the last completed step
        where that is safe (one process, not inside a step) and re-raises. SIGTERM (a SLURM time
        limit, preemption, ``scancel``) lets the current step finish, saves it on every rank and
        raises :class:`~nemo_fp8_recipes.trainer.result.Terminated`."""
        with self._stop_on_sigterm():
            if self.result is None:
                self.setup()
            return self._run()

    @contextlib.contextmanager
    def _stop_on_sigterm(self):
        """While training: SIGTERM asks the loop to stop after the step in progress (the handler
        only sets :attr:`stop_signal`; the loop saves). The previous handler comes back after. Not
        in a thread other than the main one, where Python cannot catch signals."""
        self.stop_signal: Optional[str] = None
        self.stop_agreed = False  # every rank has been told to stop (the flag reduced over ranks)
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def ask_to_stop(signum, frame):
            if self.stop_signal is None:
                self.stop_signal = signal.Signals(signum).name
                log.warning("%s received: stopping after the step in progress, with a checkpoint", self.stop_signal)

        previous = signal.signal(signal.SIGTERM, ask_to_stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self) -> TrainResult:
        tcfg = self.tcfg
        if self.start_step >= tcfg.max_steps:
            log.info(
                "run already complete at step %d (trainer.max_steps=%d); nothing to do", self.start_step, tcfg.max_steps
            )
            self.writer.close()
            self.result.wall_s = time.perf_counter() - self.t_start
            return self.result
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        show_bar = tcfg.progress and sys.stderr.isatty() and self.ctx.is_main
        self.bar = tqdm(
            total=tcfg.max_steps,
            initial=self.start_step,
            disable=not show_bar,
            dynamic_ncols=True,
            desc=f"{self.mcfg.name}/{self.recipe.name}",
            unit="step",
        )
        self.model.train()
        try:
            with logging_redirect_tqdm():
                if self.stop_signal is not None and not self.ctx.distributed:
                    self._stop_on_signal()  # told to stop while setting up
                while self.global_step < tcfg.max_steps:
                    self._after_step(self.step())
                    if self.stop_agreed:
                        self._stop_on_signal()
        except KeyboardInterrupt:
            self.bar.close()
            self._save_on_interrupt()
            raise
        finally:
            self.bar.close()
            self.writer.close()
        return self.finish()

    def step(self) -> StepStats:
        """One optimizer step: ``accum`` micro-batches forward and backward (gradients summed),
        the loss averaged over ranks, gradient clipping, the non-finite check, the optimizer,
        delayed-scaling and scheduler updates."""
        tcfg, ctx, step = self.tcfg, self.ctx, self.global_step
        self.mid_step = True
        t0 = time.perf_counter()
        self.telemetry_due = self.telemetry_on and (step + 1) % tcfg.telemetry_interval == 0
        if self.telemetry_due:
            self.backend.start_telemetry(self.raw_model)
        loss_acc = torch.zeros((), device=self.device)
        aux_acc = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            # rank r takes micro-batches [r·accum, (r+1)·accum) of the global step, and
            # back-propagates loss / (all micro-batches): gradients are summed over ranks
            x, y = self.train_batches.get(step, ctx.rank * self.accum + micro, self.device)
            out = self._forward_backward(x, y, micro)
            loss_acc += out.ce_loss.detach()
            aux_acc += out.aux_loss.detach()
        self.stop_agreed = self.stop_signal is not None
        if ctx.distributed:
            # the stop request rides on the loss reduction: every rank stops after the same step
            stop = torch.full((), float(self.stop_agreed), device=self.device)
            both = all_reduce_sum(torch.stack([loss_acc, aux_acc, stop]), ctx)
            loss_acc, aux_acc = both[0], both[1]
            self.stop_agreed = bool(both[2] > 0)
        loss = float(loss_acc) / tcfg.grad_accum
        clip = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.dp_model.parameters(), clip)))
        lr = self.optimizer.param_groups[0]["lr"]
        bad = None
        if not math.isfinite(loss):
            bad = ("loss", loss)
        elif not math.isfinite(grad_norm):
            bad = ("gradient norm", grad_norm)
        if bad is not None:
            self.optimizer.zero_grad(set_to_none=True)
            if tcfg.nan_policy == "stop":
                raise NonFiniteLossError(step + 1, bad[0], bad[1], self.last_ckpt)
            self.backend.skipped_step(self.raw_model)
            self.skipped += 1
            log.warning(
                "step %d: non-finite %s (%s); batch skipped (%d skipped so far), its delayed-scaling amaxes discarded",
                step + 1,
                bad[0],
                bad[1],
                self.skipped,
            )
            if self.skipped > tcfg.max_skipped_steps:
                raise NonFiniteLossError(step + 1, bad[0], bad[1], self.last_ckpt)
        else:
            self.backend.after_optimizer_step(self.raw_model)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        self.tokens_seen += self.tokens_per_step
        self.mid_step = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepStats(
            loss=loss,
            aux_loss_sum=aux_acc,
            lr=lr,
            grad_norm=grad_norm,
            skipped=bad is not None,
            time_s=time.perf_counter() - t0,
        )

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, micro: int):
        """Forward and backward of micro-batch ``micro`` of the step; the gradients are synced
        over the ranks with the last one. Returns the model output."""
        tcfg = self.tcfg
        if self.graphs:
            self.graphs.mark()
        try:
            with (
                grad_sync(self.dp_model, tcfg.data_parallel, self.ctx, micro == self.accum - 1),
                self.autocast(),
                self.backend.autocast(micro == 0),
            ):
                out = self.model(x, y)
                (out.loss / tcfg.grad_accum).backward()
        except Exception as e:
            self._raise_if_nondeterministic(e)
            if tcfg.compile and type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise TrainingError(
                    f"torch.compile failed for recipe {self.recipe.name}: {str(e).splitlines()[0]}; "
                    "run with trainer.compile=false"
                ) from e
            raise
        return out

    def _raise_if_nondeterministic(self, e: BaseException) -> None:
        """trainer.deterministic=true met an operator without a deterministic implementation."""
        msg = explain_nondeterministic_op(e, str(self.device)) if self.tcfg.deterministic else None
        if msg:
            raise TrainingError(msg) from e

    def _after_step(self, stats: StepStats) -> None:
        """What follows each optimizer step: history and timing, the first step's audit, FP8
        telemetry, the log line, and validation and a checkpoint when due."""
        tcfg, step = self.tcfg, self.global_step
        self.result.history.append(
            {"step": step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm, "skipped": stats.skipped}
        )
        self.window.add(stats.loss, stats.time_s, self.tokens_per_step)
        if step > self.start_step + 1:  # the first step pays compile/warm-up costs
            self.step_time_total += stats.time_s
            self.steps_timed += 1
        if step == self.start_step + 1:
            if self.start_step == 0:
                self.write_audit()
            self.result.cuda_graph_skips = self.graphs.report() if self.graphs else None
        if self.telemetry_due:
            self.log_telemetry()
        self.log_step(stats)
        last = step == tcfg.max_steps
        if self.val_batches is not None and (step % tcfg.val_interval == 0 or last):
            self.mid_step = True  # validation swaps the FP8 state out and back
            val_loss = self.evaluate()
            self.mid_step = False
            self.result.val.append((step, val_loss))
            self.writer.scalars({"val/loss": val_loss}, step)
            log.info("step %d | val/loss %.4f", step, val_loss)
        if tcfg.checkpoint and ((tcfg.ckpt_interval and step % tcfg.ckpt_interval == 0) or last):
            self.checkpoint(step)
        self.writer.flush()

    # ---- reporting ----
    def write_audit(self) -> None:
        """The precision audit of the first step (what ran in FP8, per module and GEMM), in the
        run directory, TensorBoard and the log."""
        report = self.backend.audit(self.raw_model)
        if not self.bf16 and hasattr(report, "computed_in"):  # no BF16 autocast: they ran in FP32
            report = report.computed_in("fp32")
        notes = [n for n in (self.backend.audit_note(),) if n]
        if self.device.type == "cpu":
            notes.append(
                "(on the CPU the FP8 linears run the emulation: the kernel options above apply to CUDA GPUs, "
                "where the Triton kernels run)"
            )
        self.result.audit_table = record_audit(
            report,
            self.ctx,
            run_dir=self.run_dir,
            writer=self.writer,
            step=self.global_step,
            extra="\n".join(notes) or None,
            data_parallel=self.tcfg.data_parallel,
        )

    def log_telemetry(self) -> None:
        """FP8 statistics per layer group (amax, scale, under/overflow) of this step, to TensorBoard."""
        tel = self.backend.collect_telemetry(self.raw_model)
        self.writer.scalars(reduce_telemetry(tel, self.ctx), self.global_step)

    def log_step(self, stats: StepStats) -> None:
        """The progress bar; every ``trainer.log_interval`` steps and at the last one, the
        window's mean loss, lr, gradient norm, throughput and MFU to TensorBoard and the log."""
        tcfg, step, window = self.tcfg, self.global_step, self.window
        tps = window.tokens_per_s
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=format_count(tps), refresh=False)
        if not (tcfg.log_interval and (step % tcfg.log_interval == 0 or step == tcfg.max_steps)):
            return
        avg = window.mean_loss
        tflops = tps * self.flops_per_token / 1e12
        mfu = tflops / self.peak if self.peak else None
        scalars = {
            "train/loss": avg,
            "train/loss_step": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": tps,
            "perf/tflops_per_s": tflops,
            "perf/mfu": mfu,
            "train/tokens_seen": self.tokens_seen,
            "train/skipped_steps": self.skipped,
        }
        if self.mcfg.arch == "moe":
            scalars["train/aux_loss"] = float(stats.aux_loss_sum) / tcfg.grad_accum
        if self.device.type == "cuda":
            scalars["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.writer.scalars(scalars, step)
        log.info(
            "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.2f TFLOP/s | mfu %s",
            step,
            tcfg.max_steps,
            avg,
            stats.lr,
            stats.grad_norm,
            format_count(tps),
            tflops,
            f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
        )
        window.reset()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation set.

        Evaluation must not steer training: the FP8 scaling state (delayed-scaling amax
        histories, pending amaxes, cached weight quantisations) is restored afterwards, so a run
        with validation follows the same trajectory as one without, and a checkpoint written
        right after validation resumes exactly.
        """
        snapshot = self.backend.snapshot(self.raw_model)
        self.model.eval()
        total, n = 0.0, 0
        try:
            for x, y in self.val_batches.iter(self.device):
                if self.graphs:
                    self.graphs.mark()
                with self.autocast(), self.backend.autocast(None):
                    try:
                        out = self.model(x, y)
                    except RuntimeError as e:
                        self._raise_if_nondeterministic(e)
                        raise
                total += float(out.ce_loss)
                n += 1
        finally:
            self.model.train()
            self.backend.restore(self.raw_model, snapshot)
        return total / max(1, n)

    # ---- checkpoints and the end ----
    def resume_settings(self) -> Dict[str, Any]:
        """What else decides what a run computes (beyond the recipe, model and trainer settings a
        resume compares): the precision policy and the kernel options, as configured."""
        from omegaconf import OmegaConf

        policy = self.cfg.get("policy")
        return {
            "policy": OmegaConf.to_container(policy, resolve=True) if policy is not None else None,
            "kernels": self.kernel_options.as_dict(),
        }

    def state_dict(self, step: int) -> Dict[str, Any]:
        """The checkpoint of ``step``: model (with FP8 scaling state) and optimizer as full
        FQN-keyed state (a collective under FSDP2), scheduler, RNG, counters, data position,
        the open logging window, and what :func:`~nemo_fp8_recipes.checkpoint.check_compatible`
        compares on resume."""
        from omegaconf import OmegaConf

        tcfg, ctx = self.tcfg, self.ctx
        model_sd, optim_sd = state_dicts(self.dp_model, self.optimizer)
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped,
            "model": model_sd,
            "optimizer": optim_sd,
            "world_size": ctx.world_size,
            "data_parallel": tcfg.data_parallel if ctx.distributed else None,
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "data": {
                "fingerprint": self.corpus.fingerprint,
                "seed": tcfg.seed,
                "next_step": step,
                "consumed_samples": step * self.train_batches.samples_per_step,
            },
            # the train/loss logging window open at this step, so a resumed run logs the same mean
            "log_window": self.window.state(),
            "recipe": self.recipe.describe(),
            "backend": self.backend.name,
            "model_config": self.mcfg.to_dict(),
            "trainer": dataclasses.asdict(tcfg),
            "settings": self.resume_settings(),
            "config_yaml": OmegaConf.to_yaml(self.cfg, resolve=True),
        }

    def checkpoint(self, step: int) -> Path:
        """Save the checkpoint of ``step`` (every rank gathers its state, rank 0 writes) and wait
        until it is in place on every rank."""
        state = self.state_dict(step)
        if self.ctx.is_main:
            self.ckpt_mgr.save(step, state)
        self.last_ckpt = self.ckpt_mgr.path_for(step)
        barrier(self.ctx)  # no rank goes on (or resumes) before the file is in place
        self.result.checkpoint = self.last_ckpt
        log.info("checkpoint: %s", self.last_ckpt)
        return self.last_ckpt

    def _stop_on_signal(self) -> None:
        """After a completed step, told to stop: save it (unless saved already or checkpointing
        is off) and raise :class:`Terminated`."""
        step = self.global_step
        saved = self.last_ckpt is not None and self.last_ckpt == self.ckpt_mgr.path_for(step)
        if self.tcfg.checkpoint and step > self.start_step and not saved:
            self.checkpoint(step)
        raise Terminated(
            self.stop_signal or "SIGTERM",
            step,
            self.last_ckpt if self.tcfg.checkpoint else None,
            bool(self.tcfg.checkpoint),
        )

    def _save_on_interrupt(self) -> None:
        """Ctrl-C: save the last completed step if that is safe, and say what is kept."""
        step, last = self.global_step, self.last_ckpt or "none"
        if self.mid_step:
            # A half-finished step (e.g. optimizer updated, counters not) must not be saved
            # under a completed step's name.
            log.warning("interrupted inside step %d; not saving a partial step. Last checkpoint: %s", step + 1, last)
        elif self.ctx.distributed:
            # saving is a collective; the other ranks are being interrupted too
            log.warning("interrupted after step %d; last checkpoint: %s", step, last)
        else:
            log.warning("interrupted after step %d", step)
            if step > self.start_step and self.tcfg.checkpoint:
                self.checkpoint(step)

    def finish(self) -> TrainResult:
        """The final numbers: into the result, ``summary.json`` (rank 0) and the closing log line."""
        result, tcfg, step = self.result, self.tcfg, self.global_step
        result.final_step = step
        result.skipped_steps = self.skipped
        result.tokens_per_s = (
            self.tokens_per_step * self.steps_timed / self.step_time_total if self.step_time_total else None
        )
        result.wall_s = time.perf_counter() - self.t_start
        result.cuda_graph_skips = self.graphs.close() if self.graphs else None
        tail = [h["loss"] for h in result.history[-max(1, tcfg.log_interval or 1) :] if math.isfinite(h["loss"])]
        final_train = float(np.mean(tail)) if tail else float("nan")
        if self.ctx.is_main:
            cuda = self.device.type == "cuda"
            (self.run_dir / "summary.json").write_text(
                json.dumps(
                    {
                        "model": self.mcfg.name,
                        "recipe": self.recipe.name,
                        "mode": self.mode,
                        "params": self.n_params,
                        "steps": step,
                        "final_train_loss": final_train,
                        "final_val_loss": result.val[-1][1] if result.val else None,
                        "tokens_per_s": result.tokens_per_s,
                        "skipped_steps": self.skipped,
                        "world_size": self.ctx.world_size,
                        "data_parallel": tcfg.data_parallel if self.ctx.distributed else None,
                        "wall_s": result.wall_s,
                        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                        "kernel_options": self.kernel_options.as_dict(),
                        "compile": tcfg.compile,
                        "compile_mode": tcfg.compile_mode if tcfg.compile else None,
                        "deterministic": tcfg.deterministic,
                        "cuda_graph_skips": result.cuda_graph_skips,
                        "peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None,
                        # what it trained on, by content (paired runs must share it: nemo-fp8-compare)
                        "data_sha256": self.corpus.tokens_sha256,
                    },
                    indent=2,
                )
                + "\n",
                encoding="utf-8",
            )
        log.info(
            "done: %d steps in %s | train loss %.4f%s | %s tok/s | run dir %s",
            step - self.start_step,
            format_duration(result.wall_s),
            final_train,
            f" | val loss {result.val[-1][1]:.4f}" if result.val else "",
            format_count(result.tokens_per_s or 0),
            self.run_dir,
        )
        return result

    def close(self) -> None:
        """End the process group :meth:`setup` started (nothing when it started none), undo the
        process-wide switches of ``trainer.deterministic`` and release the run directory."""
        try:
            if self.ctx is not None:
                self.ctx.close()
        finally:
            self._process_settings.close()


def train(cfg) -> TrainResult:
    """Run the embedded trainer on a composed config (``DictConfig``) and return what it did:
    ``Trainer(cfg).run()``, then the process group is closed whatever happened.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls it: data parallelism with
    ``trainer.data_parallel`` (ddp | fsdp2, :mod:`nemo_fp8_recipes.trainer.distributed`); rank 0 logs,
    writes TensorBoard, the audit and checkpoints. Every rank returns the same losses.

    Raises :class:`ConfigError`, :class:`~nemo_fp8_recipes.data.DataError`,
    :class:`~nemo_fp8_recipes.recipes.UnsupportedRecipeError`, :class:`CheckpointError` or
    :class:`NonFiniteLossError` with actionable messages; :func:`main` prints them cleanly.
    """
    trainer = Trainer(cfg)
    level = log.level  # a non-main rank logs warnings only while it trains
    try:
        return trainer.run()
    finally:
        log.setLevel(level)
        trainer.close()
