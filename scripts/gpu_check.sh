#!/usr/bin/env bash
# The whole GPU verification of the attention kernels, as one command:
#   1. make the project and CuPy importable: the project itself (pip install -e . --no-deps)
#      where `import actorllm.spec` fails (a bare checkout on sys.path lacks the spec/ that
#      the package maps in), the project's missing runtime packages, and cupy-cuda12x /
#      -cuda13x to match torch's CUDA, each only if its import fails; from $WHEEL_DIR without
#      an index when that is set, for machines without network (such as the device
#      machines, whose image has torch and CuPy but not trio or pyzmq); then check that
#      NVRTC compiles a trivial kernel;
#   2. the sliding-window and soft-cap additions to the kernels (issue 30), as a step of
#      their own so the log says how they fared: the decode and prefill kernels against
#      the torch reference with windows and caps (fixed and hypothesis cases,
#      tests/gpu/test_cuda_attention.py), whole windowed and soft-capped models (Gemma 2,
#      Gemma 3, windowed Mistral) on the cuda backend against the torch backend
#      (tests/gpu/test_engine_cuda.py), and the torch reference itself against a naive
#      oracle (tests/test_models_attention.py);
#   3. the rest of the GPU tests (tests/gpu, CUDA graphs of decode steps among them:
#      tests/gpu/test_graphs_cuda.py, issue 28) and the CPU tests of the ops, with skip
#      reasons shown;
#   4. benchmarks/cuda_kernels.py (writes benchmarks/results/kernels.{json,md});
#   5. benchmarks/gpu_engine.py --rounds 2: the engine with the torch and cuda attention,
#      and with CUDA graphs (writes benchmarks/results/gpu_engine.{json,md}).
# Everything printed is also written to benchmarks/results/gpu_check.log.
# On a lent machine without a package index, scripts/gpu_wheels.sh (run here first) puts
# the missing wheels in .whl/ and says how to carry them (WHEEL_DIR=.whl).
# Usage: scripts/gpu_check.sh [extra args for benchmarks/cuda_kernels.py, e.g. --quick]
# Exit status: 0 when tests and benchmark pass, 2 without a GPU, else the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
PYTHON=${PYTHON:-python3}

# pip-installed CUDA libraries (NVRTC, runtime) that came with torch, for CuPy to dlopen.
nvidia_libs=$("$PYTHON" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH="${nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

main() {
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to torch; nothing to check"
    return 2
  fi
  "$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'gpu_check: {p.name}, sm_{p.major}{p.minor}, torch {torch.__version__} (CUDA {torch.version.cuda})')"

  pip_install() {
    if [ -n "${WHEEL_DIR:-}" ]; then
      "$PYTHON" -m pip install -q --no-index --find-links "$WHEEL_DIR" "$@"
    else
      "$PYTHON" -m pip install -q "$@"
    fi
  }
  for need in trio:trio zmq:pyzmq pytest_trio:pytest-trio attrs:attrs msgpack:msgpack \
              prometheus_client:prometheus-client hypothesis:hypothesis; do
    if ! "$PYTHON" -c "import ${need%%:*}" 2>/dev/null; then
      echo "gpu_check: ${need%%:*} is not importable; installing ${need#*:}"
      pip_install "${need#*:}" || echo "gpu_check: could not install ${need#*:}"
    fi
  done
  if ! "$PYTHON" -c "import actorllm.spec" 2>/dev/null; then
    echo "gpu_check: actorllm is not installed; installing this checkout (editable, no deps)"
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . \
      || echo "gpu_check: could not install the checkout; the tests will not load"
  fi
  if ! "$PYTHON" -c "import cupy" 2>/dev/null; then
    major=$("$PYTHON" -c "import torch; print(torch.version.cuda.split('.')[0])")
    pkg="cupy-cuda${major}x"
    echo "gpu_check: cupy is not importable; installing $pkg"
    pip_install "$pkg" || echo "gpu_check: could not install $pkg; the GPU tests will be skipped"
  fi
  "$PYTHON" - <<'EOF' || echo "gpu_check: CuPy/NVRTC smoke test failed (see above)"
import cupy
k = cupy.RawKernel(r'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }', "k")
x = cupy.zeros(32, dtype=cupy.float32)
k((1,), (32,), (x,))
assert float(x.sum()) == 32.0
print(f"gpu_check: cupy {cupy.__version__} compiles and runs kernels")
EOF

  local status=0 features="window or softcap or test_models_attention"
  echo "gpu_check: sliding-window and soft-cap attention (issue 30) against the torch reference"
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -k "$features" tests/gpu \
    tests/test_models_attention.py || status=$?
  echo "gpu_check: the other GPU tests and the ops' CPU tests"
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -k "not ($features)" tests/gpu \
    tests/test_ops_reference.py tests/test_ops_cuda_host.py || { [ "$status" -ne 0 ] || status=$?; }
  "$PYTHON" benchmarks/cuda_kernels.py "$@" || { [ "$status" -ne 0 ] || status=$?; }
  echo "gpu_check: the engine on the GPU, eager and with CUDA graphs (issue 28)"
  "$PYTHON" benchmarks/gpu_engine.py --rounds 2 || { [ "$status" -ne 0 ] || status=$?; }
  return "$status"
}

main "$@" 2>&1 | tee benchmarks/results/gpu_check.log
exit "${PIPESTATUS[0]}"
