"""What several test files share and that is not a test or a fixture: the float64 reference
quantisers (``fp8_ref``), Megatron-Core model builders (``megatron_utils``), the skip reasons of the
``gpu`` and ``te`` markers (``skips``), the numerics tables printed after a run (``report``), the
benchmark importer (``benchmarks``), the raw event reader (``events``), the compiled-linear models
and steps (``traced``), the small trainer shapes of the CPU runs (``tiny``), the tiny Hugging Face MoE
models built offline (``hf_moe``), and the ahead-of-time Triton check (``triton_aot``, a script).
Imported as ``helpers.<module>`` (pytest puts ``tests/`` on ``sys.path``)."""
