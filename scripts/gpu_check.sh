#!/usr/bin/env bash
# The GPU check in three parts, each one device call of under 10 minutes (docs/gpu.md):
#   scripts/gpu_check.sh --part 1|2|3 [--dry] [--budget SECONDS] [--no-tests]
#   scripts/gpu_check.sh --part all --dry      # every part on tiny shapes on the CPU (what CI runs)
# Writes gpu_check_part<N>.{json,md,log} (and pytest_gpu.xml for part 1) to $OUT, or ./gpu_check_out when
# $OUT is unset. Uses the machine's own torch (the report names its version); wheels carried in .whl/ (e.g.
# torchdata, which the device image lacks) are installed first, without dependencies and without the network.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export OUT
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-index .whl/*.whl
fi
exec "$PY" -m outlier_titan.gpu_check --out "$OUT" "$@"
