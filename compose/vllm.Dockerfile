# The inference service on vLLM (gpu profile): the official vLLM image plus Flywheel.
#   docker build -f compose/vllm.Dockerfile -t flywheel-vllm .
# vLLM's image brings torch (CUDA), transformers and vllm; Flywheel's own requirements are
# added without touching them (flywheel-rl's models extra pins torch 2.13.0, which this
# image must not get: vLLM needs its own). Not built here (no registry): checked by
# `docker-compose config` only. A run picks vLLM with `inference.backend = "vllm"` in its config.
ARG VLLM_BASE_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# bubblewrap: environment code runs only in environment workers, each a bubblewrap sandbox.
RUN command -v bwrap >/dev/null || { apt-get update && apt-get install -y --no-install-recommends bubblewrap \
        && rm -rf /var/lib/apt/lists/*; }
COPY pyproject.toml /src/pyproject.toml
COPY compose/requirements.py /src/compose/requirements.py
# Everything the inference service needs except torch, constrained to the versions vLLM's
# image already has (pip does not weigh installed packages' own pins): a clash fails the
# build here instead of breaking vLLM at run time.
RUN python3 /src/compose/requirements.py /src/pyproject.toml inference,telemetry | grep -v '^torch' > /tmp/requirements.txt \
    && python3 -m pip freeze | grep -v ' @ ' > /tmp/constraints.txt \
    && python3 -m pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/constraints.txt
COPY README.md /src/README.md
COPY shared /src/shared
COPY services /src/services
COPY environments /src/environments
RUN python3 -m pip install --no-deps /src && rm -rf /src/build
COPY compose/healthcheck.py /usr/local/bin/flywheel-healthcheck
RUN chmod +x /usr/local/bin/flywheel-healthcheck

ENV FLYWHEEL_DATA_DIR=/data
WORKDIR /data
# The base image's entrypoint is vLLM's own server; compose gives the command.
ENTRYPOINT []
CMD ["python3", "-m", "flywheel_inference"]
