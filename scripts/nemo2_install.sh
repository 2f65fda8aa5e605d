#!/usr/bin/env bash
# ON THE GPU MACHINE, in a call that carries .nemo2 (made by scripts/nemo2_prepare.sh), after a call
# that ran .te/install.sh on the same warm machine (.te and .nemo2 together exceed the carry limit):
#   bash .nemo2/install.sh && export PYTHONPATH=/tmp/nemo2site:/tmp/site:$PWD || exit;
# Installs NeMo 2.7.3, megatron-core 0.15.3 and what they import that the image lacks into /tmp/nemo2site,
# apart from Bridge's /tmp/site (TE stays there). Skips everything on a warm machine that has it already.
set -uo pipefail
src=$(cd "$(dirname "$0")" && pwd)
target=/tmp/nemo2site
export PYTHONPATH=$target:/tmp/site
check='import nemo.collections.llm as l, megatron.core as c; assert hasattr(l, "pretrain"), "no llm.pretrain"; print("NeMo 2 ready: megatron-core", c.__version__)'
if python3 -c "$check" 2>/dev/null; then echo "NeMo 2: already installed in $target"; exit 0; fi
python3 -c "import transformer_engine.pytorch" 2>/dev/null \
  || { echo "Transformer Engine is not in /tmp/site: run bash .te/install.sh (a call carrying .te) first"; exit 1; }
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$src"/*.whl \
  2>&1 | grep -v -i "already exists" || true
python3 -c "$check" 2>&1 | grep -v -i warn | tail -3
python3 -c "$check" >/dev/null 2>&1 || { echo "NeMo 2 does not import from $target (see above)"; exit 1; }
echo "installed in $(( $(date +%s) - t0 )) s; use: export PYTHONPATH=$target:/tmp/site:\$PWD"
