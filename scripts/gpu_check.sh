#!/usr/bin/env bash
# The GPU check in four parts, each one device call of under 10 minutes (docs/gpu.md):
#   scripts/gpu_check.sh --part 1|2|3|4|2,3,4 [--dry] [--budget SECONDS] [--no-tests]
#   scripts/gpu_check.sh --part all --dry      # every part on tiny shapes on the CPU (what CI runs)
# Writes gpu_check_part<N>.{json,md,log} (and pytest_gpu.xml for part 1) to $OUT, or ./gpu_check_out when
# $OUT is unset. Uses the machine's own torch (the report names its version).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export OUT
# Pure-Python wheels carried in .whl/ (e.g. torchdata, which the device image lacks) are unpacked into a
# temporary folder put last on PYTHONPATH: no pip, no network, and the machine's own packages win.
if compgen -G ".whl/*.whl" > /dev/null; then
    WHEELS="$(mktemp -d)"
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$WHEELS"; done
    export PYTHONPATH="$PYTHONPATH:$WHEELS"
    echo "unpacked onto PYTHONPATH: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
exec "$PY" -m outlier_titan.tools.gpu_check --out "$OUT" "$@"
