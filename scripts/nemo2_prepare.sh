#!/usr/bin/env bash
# Bring NeMo 2 (nemo_toolkit 2.7.3, megatron-core 0.15.3) to the GPU machine for scripts/nemo2_smoke.py:
# run HERE, from the project root. Fills ./.nemo2/ (git-ignored) with the Python 3.12 manylinux wheels
# that `import nemo.collections.llm` and `llm.pretrain` import at module level and the GPU image lacks
# (or has in a version NeMo 2.7 cannot use), plus .nemo2/install.sh. The set was found by tracing the
# smoke run's imports on a CPU up to its first CUDA call, then dropping each package whose absence
# still let it get there; with it, scripts/nemo2_smoke.py trained every Hopper recipe on an H100
# (2026-12-07, TE 2.20.2, torch 2.11).
# Needs Transformer Engine in .te too (shared/device/te/prepare.sh; once .te/te_ext.tar.xz exists,
# delete .te/nvidia_cudnn_frontend*.whl and .te/*.tar.gz, which only TE's build needs).
# The carry limit is 64 MiB with the working tree, and .nemo2 (about 49 MB) does not fit beside .te
# (about 32 MB slimmed), so it takes TWO device calls, the second within 30 s of the first (a warm
# machine keeps /tmp: both install scripts skip what is there):
#   call 1, carry [".te"]:    bash .te/install.sh
#   call 2, carry [".nemo2"]: bash .nemo2/install.sh /tmp/nemo2site && export PYTHONPATH=/tmp/nemo2site:/tmp/site:$PWD &&
#     python scripts/nemo2_smoke.py   (install.sh stops, saying so, when call 1's TE is not there)
# NeMo goes to /tmp/nemo2site, never into Bridge's /tmp/site: it cannot share an environment with
# Megatron-Bridge 0.6.2 or megatron-core >= 0.17, and /tmp/nemo2site must come first on PYTHONPATH.
# Known traps (seen with these versions on a CPU, and on the GPU where said):
#   - the image's transformers 5.x, tokenizers 0.23.2+, huggingface_hub 1.x and lightning 2.6 break NeMo
#     2.7.3: the older ones here shadow them (transformers 4.57 checks its tokenizers/hub ranges at import);
#   - leptonai >= 0.47 breaks `import nemo_run`; leptonai 0.27.3 imports exceptiongroup even on 3.12;
#   - without PuLP (imported by nvidia-modelopt) nemo.collections.llm silently has no `pretrain`;
#     PuLP bundles CBC solver binaries for every OS (16 MB): only the x86-64 Linux one is kept;
#   - nemo_toolkit's nlp extra pins numpy<2 and the issue's set used numpy 1.26.4 + pyarrow 22: not
#     needed (the CPU trace got as far with numpy 2.4 and pyarrow 26), so the image's numpy 2.5 and
#     pyarrow are used rather than carrying 60 MB of numpy 1.26 + pyarrow 22;
#   - NeMo 2.7.3's async checkpoint IO imports megatron.core.dist_checkpointing.strategies.tensorstore,
#     gone in megatron-core 0.16: MegatronStrategy(ckpt_async_save=False) (the smoke script sets it);
#   - NeMo 2.7.3's optimizer setup calls get_megatron_optimizer(no_weight_decay_cond=...), which
#     megatron-core 0.16 removed: with 0.16.1 the model builds (TE 2.20.2, H100) and every recipe stops
#     there with a TypeError (seen on the GPU, 2026-12-06); 0.15.3 still takes it;
#   - megatron-core 0.15.3 declares transformer-engine < 2.10; .te carries 2.20.2 (--no-deps installs it).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
here=$(cd "$(dirname "$0")" && pwd)
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.nemo2/' "$exclude" 2>/dev/null || echo '/.nemo2/' >> "$exclude"
mkdir -p .nemo2
rm -f .nemo2/*.whl
# No tag above 2_28: the image's glibc is older than 2.39 (Bridge unpacks a 2_39 wheel) and unread.
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
# One version of each; these shadow the image's copies where it has others (transformers, lightning, ...).
pkgs=(
  asciitree==1.0.0 bcrypt==5.0.0 braceexpand==0.1.7 bracex==3.2.4 catalogue==2.0.10 cffi==2.1.1
  contextlib2==21.6.0 cryptography==51.0.1 datasets==5.0.1 decorator==5.3.2 defusedxml==0.7.1
  Deprecated==1.3.1 dill==0.4.1 docstring_parser==0.18.0 exceptiongroup==1.3.2 fabric==3.2.3 fastapi==0.163.2
  fiddle==0.3.1 google-api-core==2.33.0 google-auth==2.63.1 googleapis-common-protos==1.75.0 graphviz==0.21
  h2==4.4.1 hpack==4.2.0 huggingface_hub==0.36.2 hydra-core==1.3.2 hyperframe==6.1.0 invoke==2.2.1
  jaraco.context==6.1.0 jaraco.functools==4.6.0 jaraco.text==4.0.0 jsonschema-specifications==2025.9.1
  jsonschema==4.26.0 lark==1.3.1 lazy-importer==0.1.0 ledoc-ui==0.1.0 leptonai==0.27.3 libcst==1.9.0
  lightning==2.4.0 loguru==0.7.3 megatron-core==0.15.3 more-itertools==11.2.1 multiprocess==0.70.19
  nemo-toolkit==2.7.3 nemo_run==0.11.1 numexpr==2.13.1 nv-one-logger-core==2.3.1
  nv-one-logger-pytorch-lightning-integration==2.3.1 nv-one-logger-training-telemetry==2.3.1
  nvidia-modelopt==0.37.0 omegaconf==2.3.0 opentelemetry-api==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 overrides==7.7.0 paramiko==5.1.0 platformdirs==4.14.9
  prometheus-fastapi-instrumentator==7.0.0 PuLP==3.3.2 PyNaCl==1.6.2 PySocks==1.7.1 python-multipart==0.0.34
  pytz==2026.6 referencing==0.37.0 rpds-py==2026.9.1 sniffio==1.3.1 starlette==0.52.1 StrEnum==0.4.15
  tokenizers==0.22.2 toml==0.10.2 torchprofile==0.1.0 torchx==0.7.0 transformers==4.57.6 uvicorn==0.55.0
  wcmatch==10.2.1 webdataset==1.0.2 xattr==1.3.1 zarr==2.18.7
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .nemo2 "${pkgs[@]}"
# Source-only, pure Python: build their wheels here.
python3 -m pip wheel -q --no-deps -w .nemo2 antlr4-python3-runtime==4.9.3 wget==3.2
python3 - <<'PY'
import glob, os, zipfile
src = glob.glob(".nemo2/pulp-*.whl")[0]; tmp = src + ".tmp"
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    for i in zi.infolist():
        if "/solverdir/cbc/" in i.filename and "/linux/i64/" not in i.filename:
            continue
        zo.writestr(i, zi.read(i.filename))
os.replace(tmp, src)
PY
cp "$here/nemo2_install.sh" .nemo2/install.sh
du -sh .nemo2
# what a device call sends: the working tree (tracked and untracked files git does not ignore) plus .nemo2
tree_kb=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "a call carrying .nemo2 sends about $(( (tree_kb + $(du -sk .nemo2 | cut -f1)) / 1024 )) MiB (limit 64)"
