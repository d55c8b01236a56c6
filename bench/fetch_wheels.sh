#!/usr/bin/env bash
# Download the wheels bench/peer.py's offload row needs on the offline GPU machine into bench/wheels/ (ignored by
# git; the device tool must carry it: run(carry=["bench/wheels"])). bench/gpu_check.sh peer installs them offline.
#   torchao 0.18.0: needs torch >= 2.11 for its C++ ops (the GPU image had 2.11.0+cu130); CPUOffloadOptimizer is
#                   pure Python. cp310-abi3 wheel: any CPython >= 3.10.
#   deepspeed/:     DeepSpeed's source tarball and the dependencies the GPU image may lack (wheels for CPython 3.12,
#                   the image's; pip resolves from this folder and keeps what is installed: --find-links); installed
#                   only with PEER_DEEPSPEED=1 (numpy, tqdm, packaging, torch: from the image). Its CPU Adam op is built at run time
#                   (JIT, torch.utils.cpp_extension): it needs g++, Python.h and ninja (the ninja wheel) there.
set -eu
cd "$(dirname "$0")"
PIP=${PIP:-python3 -m pip}
mkdir -p wheels/deepspeed
$PIP download torchao==0.18.0 --no-deps -d wheels
$PIP download deepspeed==0.19.8 --no-deps --no-binary deepspeed -d wheels/deepspeed
$PIP download hjson py-cpuinfo einops ninja msgpack psutil pydantic pydantic-core annotated-types typing-inspection --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d wheels/deepspeed
ls -la wheels wheels/deepspeed
