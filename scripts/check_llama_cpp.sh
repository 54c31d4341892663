#!/usr/bin/env bash
# llama.cpp on what collab_attn.export writes: install llama-cpp-python (no wheel exists for this machine: pip builds
# llama.cpp from source, about 20 minutes on 2 cores; a wheel already built in $LLAMA_CPP_WHEELS, default
# ~/wheels, is taken instead), then run tests/test_llama_cpp.py and write its report to
# experiments/serving/llama_cpp_tests.txt. Not part of CI (the build is too long); run it from the repository root in
# the project's virtual environment:
#
#   bash scripts/check_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${LLAMA_CPP_WHEELS:-$HOME/wheels}"
if ! python -c "import llama_cpp" 2>/dev/null; then
    if compgen -G "$wheels/llama_cpp_python-*.whl" >/dev/null; then
        python -m pip install --quiet --no-deps "$wheels"/llama_cpp_python-*.whl
    else
        mkdir -p "$wheels"
        CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF" \
            python -m pip wheel --no-deps -w "$wheels" llama-cpp-python
        python -m pip install --quiet --no-deps "$wheels"/llama_cpp_python-*.whl
    fi
    python -m pip install --quiet diskcache jinja2 typing-extensions numpy  # llama-cpp-python's own dependencies
fi
report=experiments/serving/llama_cpp_tests.txt
mkdir -p "$(dirname "$report")"
tmp="$(mktemp)"
{
    echo "# $(date -u +%Y-%m-%dT%H:%MZ) llama-cpp-python $(python -c 'import llama_cpp; print(llama_cpp.__version__)'), commit $(git rev-parse --short HEAD)"
    HF_HUB_OFFLINE=1 python -m pytest -q -s -p no:cacheprovider tests/test_llama_cpp.py 2>&1 || true
} | tee "$tmp"
mv "$tmp" "$report"
echo "wrote $report"
