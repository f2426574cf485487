#!/usr/bin/env bash
# Runs ON the lent offline GPU host, from the checkout's root (tests/gpu/README.md says how).
#   recv PATH (a bundle part sent along) | reset | install [SPEC_DIR] | spec [SPEC_DIR] | source ... vars
set -u
vars() {
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
}
case ${1:-} in
recv) mkdir -p /tmp/chunks && mv "$2" /tmp/chunks/ && ls /tmp/chunks | tr '\n' ' '; echo ;;
reset) rm -rf /tmp/chunks /tmp/b /tmp/site; echo reset ;;
install)
  set -e
  rm -rf /tmp/b /tmp/site && mkdir -p /tmp/b /tmp/site
  cat /tmp/chunks/part* | tar -xf - -C /tmp/b
  tar -xJf /tmp/b/vllm.tar.xz -C /tmp/site
  PYTHONPATH= python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/b/deps/*.whl "${2:-.gpu-spec}"/*.whl 2>&1 | grep -v "already exists" || true
  echo "installed: $(du -sh /tmp/site | cut -f1)"
  vars
  python3 -c "import specshim, torch, transformers, vllm, speculators; from importlib.metadata import version; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'speculators', version('speculators'))" 2>&1 | tail -1 ;;
spec) PYTHONPATH= python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${2:-.gpu-spec}"/*.whl 2>&1 | grep -v "already exists" || true ;;
vars) vars ;;
*) echo "usage: device.sh recv PATH | reset | install [SPEC_DIR] | spec [SPEC_DIR] | vars (sourced)"; exit 2 ;;
esac
