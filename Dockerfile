# The pathways-nb image, built from this repository (pathways-nb is not installed from a registry).
#   docker build -t pathways-nb:latest .
#   docker build -t pathways-nb:tpu --build-arg EXTRA_REQUIREMENTS="jax[tpu]" .
#   docker build -t pathways-nb:cuda --build-arg EXTRA_REQUIREMENTS="jax[cuda12]" .
# Every server command is an argument: docker run pathways-nb:latest proxy --devices 4
FROM python:3.11-slim

ARG EXTRA_REQUIREMENTS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/pathways-nb
COPY . .
# This checkout, plus the accelerator's requirements (split into words, not globbed).
RUN set -f && pip install . $EXTRA_REQUIREMENTS

ENTRYPOINT ["pathways-nb"]
CMD ["--help"]
