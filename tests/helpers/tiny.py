"""The one-layer model the CPU tests train in about a second: every GEMM dim a multiple of 128 (so
blockwise converts every projection), 64 tokens a step, on the CPU, no progress bar or telemetry.
Tests add their own steps, intervals and data limits."""

TINY_SHAPE = [
    "model.num_layers=1",
    "model.dim=128",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_dim=128",
    "trainer.seq_len=32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=2",
    "trainer.progress=false",
    "trainer.device=cpu",
    "trainer.telemetry_interval=0",
]
