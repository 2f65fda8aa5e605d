#!/usr/bin/env bash
# Installs the wheels of .nemo2/ (made by scripts/nemo2_prepare.sh: NeMo 2.7.3, megatron-core 0.15.3 and
# what they import) into a folder of their own, with --no-deps and no network:
#   bash .nemo2/install.sh [DIR]      # DIR defaults to /tmp/nemo2site
#   export PYTHONPATH=DIR:$PYTHONPATH  # first: its transformers 4.57 / lightning 2.4 shadow newer copies
# NeMo 2.7 cannot share an environment with Megatron-Bridge 0.6.2 or megatron-core >= 0.17, hence the
# separate folder. Transformer Engine must already be importable (megatron-core 0.15.3 declares TE < 2.10;
# TE 2.20.2 is what trained). Skips everything when NeMo 2 already imports from DIR.
set -uo pipefail
src=$(cd "$(dirname "$0")" && pwd)
target=${1:-/tmp/nemo2site}
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
check='import nemo.collections.llm as l, megatron.core as c; assert hasattr(l, "pretrain"), "no llm.pretrain"; print("NeMo 2 ready: megatron-core", c.__version__)'
if python3 -c "$check" 2>/dev/null; then echo "NeMo 2: already installed in $target"; exit 0; fi
python3 -c "import transformer_engine.pytorch" 2>/dev/null \
  || { echo "Transformer Engine does not import (PYTHONPATH=$PYTHONPATH): install it first"; exit 1; }
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$src"/*.whl \
  2>&1 | grep -v -i "already exists" || true
python3 -c "$check" 2>&1 | grep -v -i warn | tail -3
python3 -c "$check" >/dev/null 2>&1 || { echo "NeMo 2 does not import from $target (see above)"; exit 1; }
echo "installed in $(( $(date +%s) - t0 )) s; use: export PYTHONPATH=$target:\$PYTHONPATH"
