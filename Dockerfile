# One image for every Tessera role: bootstrap, validator, miner.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libgmp-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tessera
COPY pyproject.toml constraints.txt README.md ./
COPY protocol ./protocol
COPY training ./training
COPY validator ./validator
COPY miner ./miner
COPY node ./node
# torch first, with the project's pin (constraints.txt), from PyTorch's CPU index: PyPI's Linux wheel of the
# same version is the CUDA build, which pulls gigabytes of nvidia-* wheels. Then the project itself.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt .

ENTRYPOINT ["tessera"]
CMD ["--help"]
