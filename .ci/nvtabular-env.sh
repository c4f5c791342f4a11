#!/usr/bin/env bash
# Create the isolated NVTabular environment used by `recpipe train --preprocess nvtabular`:
#   .ci/nvtabular-env.sh DIR        then: export RECPIPE_NVTABULAR_PYTHON=DIR/bin/python
# It is a separate venv on purpose: NVTabular 23.08 needs NumPy < 1.25 and pandas 1.5, which the
# serving environment (NumPy 2, current FAISS) must not get. Never install recpipe, polars, torch or
# faiss into it. Re-running on an existing, working DIR does nothing.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
dir="$1"
here="$(cd "$(dirname "$0")/.." && pwd)/recpipe/preprocess"
python="${PYTHON:-python3}"

if [ -x "$dir/bin/python" ] && "$dir/bin/python" -W ignore -c "import nvtabular" >/dev/null 2>&1; then
  echo "$dir: NVTabular environment already present"
  exit 0
fi
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "$0: needs Python 3.11 (the pins are for it); set PYTHON=python3.11" >&2
  exit 2
}
"$python" -m venv "$dir"
"$dir/bin/pip" install -q -r "$here/nvtabular-requirements.txt" -c "$here/nvtabular-constraints.txt"
"$dir/bin/python" -W ignore -c "import nvtabular; print('$dir: NVTabular', nvtabular.__version__)"
