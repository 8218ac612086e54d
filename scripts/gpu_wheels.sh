#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for scripts/gpu_check.sh, downloaded here into .whl/
# (ignored by git) so that one device call can carry them: that machine reaches no
# package index, and its image (Python 3.12, torch, CuPy, attrs, msgpack, hypothesis,
# prometheus-client) lacks trio, pyzmq and pytest-trio. Then, in the device call:
#   carry [".whl"], command:
#   WHEEL_DIR=.whl PYTHONUNBUFFERED=1 scripts/gpu_check.sh; cp benchmarks/results/{gpu_check.log,gpu_engine.*,kernels.*} $OUT/
# (gpu_check.sh installs from WHEEL_DIR only what fails to import.)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore || { echo "gpu_wheels: .gitignore should hold /.whl/" >&2; exit 1; }
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 pyzmq==27.3.0 pytest-trio==0.8.0
ls -la .whl
