"""The small models the CPU trainer tests train. ``TINY_SHAPE``: one layer, every GEMM dim a
multiple of 128 (so blockwise converts every projection), 64 tokens a step, on the CPU, no
progress bar or telemetry: a run takes about a second. ``SMALL_MODEL``: two layers with
grouped-query attention. Tests add their own batch sizes, steps, intervals and data limits."""

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

#: Two layers whose GEMM dims are multiples of 128 (every projection FP8 under every recipe), with
#: grouped-query attention (4 heads, 2 KV heads), 64-token sequences; tests add the batch sizes.
SMALL_MODEL = [
    "model.num_layers=2",
    "model.dim=256",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_dim=256",
    "trainer.seq_len=64",
]
