#!/usr/bin/env bash
# Build one venv per inference engine under .engines/<name>/ (git-ignored), idempotently:
#   .ci/engines.sh [sglang] [lmcache] [vllm]      (default: all three)
# Each venv: CPU torch==2.13.0 kept by .ci/engines/constraints.txt, the engine with --no-deps,
# its non-CUDA dependencies by name, pytest, and kvfs itself (editable, from this tree).
# A venv whose stamp matches this script is left alone; delete .engines/<name> to rebuild.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${KVFS_ENGINES_DIR:-$root/.engines}
export PIP_CONSTRAINT="$root/.ci/engines/constraints.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1
py=${PYTHON:-python3}

engine_pkg() {
    case $1 in
    sglang) echo "sglang==0.5.23" ;;
    lmcache) echo "lmcache==0.5.6" ;;
    vllm) echo "vllm==0.33.0" ;;
    *) echo "unknown engine: $1 (sglang, lmcache or vllm)" >&2; return 2 ;;
    esac
}

engine_deps() {
    case $1 in
    sglang) echo "numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
        pyzmq tqdm IPython aiohttp transformers==5.19.0 dill apache-tvm-ffi==0.1.11 triton
        sentencepiece==0.2.1 compressed-tensors gguf" ;;
    lmcache) echo "aiofile aiofiles blake3 aiohttp awscrt cryptography fastapi httpx
        huggingface_hub>=1.5.0 msgspec numpy<=2.2.6 numba nvtx
        opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp
        opentelemetry-exporter-prometheus prometheus_client psutil py-cpuinfo pyyaml pyzmq>=25
        protobuf<7,>=6.31.1 redis safetensors sortedcontainers transformers>=5.4 uvicorn
        httptools cachetools" ;;
    vllm) echo "numpy packaging msgspec psutil pyzmq regex transformers<5.21.0,>=5.16.1 cbor2
        aiohttp requests openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop
        py-cpuinfo prometheus_client fastapi partial_json_parser xgrammar llguidance" ;;
    esac
}

build() {
    local name=$1 venv="$dir/$1"
    local stamp
    stamp="$(cat "$0" "$PIP_CONSTRAINT" | sha256sum | cut -c1-16)"
    if [[ -f "$venv/.kvfs-stamp" && "$(cat "$venv/.kvfs-stamp")" == "$stamp" ]]; then
        echo "== $name: $venv is up to date"
        "$venv/bin/python" -m pip install -q -e "$root"   # this tree's kvfs, and a dependency it gained
        return
    fi
    echo "== $name: building $venv"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install -q)
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" --no-deps "$(engine_pkg "$name")"
    # shellcheck disable=SC2046
    "${pip[@]}" $(engine_deps "$name")
    "${pip[@]}" "pytest>=9.0,<9.1" "pytest-asyncio>=1.5" "pytest-timeout>=2.2"
    "${pip[@]}" -e "$root"
    if [[ $name == sglang ]]; then
        # the import-only torchvision stand-in, on the path of this venv only
        local site
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$root/.ci/engines" >"$site/kvfs-torchvision-stub.pth"
    fi
    "$venv/bin/python" -c "import torch; assert not torch.cuda.is_available(); \
assert torch.__version__.startswith('2.13.0'), torch.__version__"
    echo "$stamp" >"$venv/.kvfs-stamp"
    echo "== $name: ready ($(du -sh "$venv" | cut -f1))"
}

engines=("$@")
[[ ${#engines[@]} -gt 0 ]] || engines=(sglang lmcache vllm)
mkdir -p "$dir"
for e in "${engines[@]}"; do build "$e"; done
