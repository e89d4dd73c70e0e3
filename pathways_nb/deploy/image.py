"""The container image: a Dockerfile that installs pathways-nb from this checkout, never from a registry.

It is written next to the manifests (``pathways-nb deploy k8s``; the repository's copy is
``docs/kubernetes/Dockerfile``, which a test keeps equal to this) and built from the repository
root with ``docker build -f DIR/Dockerfile -t IMAGE .``. Accelerator
support is a build argument (``EXTRA_REQUIREMENTS``), so one Dockerfile serves
every kind of host: ``jax[tpu]`` adds libtpu, ``jax[cuda12]`` the CUDA plugin.
"""

from __future__ import annotations

DOCKERFILE = """\
# The pathways-nb image, built from this repository (pathways-nb is not installed from a registry).
# From the repository root, DIR being this file's directory (BuildKit reads Dockerfile.dockerignore beside it):
#   docker build -f DIR/Dockerfile -t pathways-nb:latest .
#   docker build -f DIR/Dockerfile -t pathways-nb:tpu --build-arg EXTRA_REQUIREMENTS="jax[tpu]" .
#   docker build -f DIR/Dockerfile -t pathways-nb:cuda --build-arg EXTRA_REQUIREMENTS="jax[cuda12]" .
# Every server command is an argument: docker run pathways-nb:latest proxy --devices 4
FROM python:3.11-slim

ARG EXTRA_REQUIREMENTS=""
ENV PYTHONUNBUFFERED=1 \\
    PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/pathways-nb
COPY . .
# This checkout, plus the accelerator's requirements (split into words, not globbed).
RUN set -f && pip install . $EXTRA_REQUIREMENTS

ENTRYPOINT ["pathways-nb"]
CMD ["--help"]
"""

DOCKERIGNORE = """\
# What the pathways-nb image does not need from the checkout.
.git
.venv*
**/__pycache__
**/*.egg-info
**/.ipynb_checkpoints
.pytest_cache
.ruff_cache
build
dist
test-artifacts
tests
benchmarks
binder
notebooks
docs
# A cluster token written by pathways-nb deploy k8s must never end up in an image.
**/secret.yaml
"""
