#!/usr/bin/env bash
# The GPU checks in one command, for a lent CUDA machine (docs/runtime.md, "Measured on a GPU"):
# benchmarks/gpu_check.py, benchmarks/gpu_cp_blocks.py, then tests/gpu. Run from the repository root (or a clean copy of it):
#
#     bash benchmarks/gpu_run.sh            # logs and results go to $OUT (default /tmp/gpu_out)
#
# The lent machines have no internet: Python packages they lack (ortools, immutabledict, a
# protobuf that ortools accepts) travel as wheels in ./.whl (cp312 manylinux; see the device notes)
# and are installed into /tmp/site. Their torch may be older than setup.cfg's floor: the run
# records the version it had (env.txt, and the report's "torch").
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c "import sys, torch, ortools; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda,
'| ortools', ortools.__version__, '|', torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')"
} 2>&1 | tee "$OUT/env.txt"

rc=0
# the report and profile straight into $OUT: the lent machine hands back 8 files at most
# GPU_CHECK_ARGS: e.g. --other-profile benchmarks/results/gpu_check-NVIDIA_H100_80GB_HBM3-profile.json (out of sample)
timeout "${GPU_CHECK_TIMEOUT:-240}" "$PY" benchmarks/gpu_check.py --out "$OUT" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
timeout "${GPU_CP_TIMEOUT:-120}" "$PY" benchmarks/gpu_cp_blocks.py --out "$OUT"
cp_rc=$?
timeout "${GPU_TESTS_TIMEOUT:-300}" "$PY" -m pytest tests/gpu -m cuda -x -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu_check exit $check_rc, gpu_cp_blocks exit $cp_rc, tests/gpu exit $tests_rc" | tee -a "$OUT/env.txt"
[ "$check_rc" = 0 ] && [ "$cp_rc" = 0 ] && [ "$tests_rc" = 0 ] || rc=1
exit $rc
