# domino-lab image: every service of docker-compose.yml (mlflow server, optuna-dashboard, sweep workers, the
# dashboard app) runs from it.
#
#   docker build -t domino-lab .                                  # CPU torch (default, ~1 GB)
#   docker build -t domino-lab:cuda --build-arg TORCH_VARIANT=cuda .   # CUDA torch (PyPI's Linux build)
#
# The CUDA variant needs the NVIDIA driver and container toolkit on the host (docker run --gpus all ...);
# the CUDA runtime libraries come inside the torch wheel, so the base image stays the same.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
# cpu: the CPU-only wheel from the PyTorch index; cuda: the default (CUDA) wheel from the package index
ARG TORCH_VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HOME=/cache/huggingface \
    DOMINO_LAB_CACHE=/cache/domino-lab

WORKDIR /app

# a C++ compiler: the Domino head's default inference path (head_impl=fused) builds its CPU loop on first use;
# without one it falls back to the slower torch path with a warning
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first and on its own layer: an unpinned torch would pull a multi-GB CUDA build into the CPU image
RUN if [ "$TORCH_VARIANT" = "cpu" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}"; \
    elif [ "$TORCH_VARIANT" = "cuda" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    else \
        echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 1; \
    fi

# the package (with its embedded default target and drafters) and the scale-out extras: the PostgreSQL
# driver that plain postgresql:// and postgresql+psycopg:// URLs use (SQLAlchemy 2.1 defaults to psycopg 3)
# and the Optuna dashboard
COPY pyproject.toml README.md ./
COPY domino_lab ./domino_lab
RUN pip install --no-cache-dir -e . "psycopg[binary]>=3.2.1" "optuna-dashboard>=0.21,<0.22"

# recipes, sweeps, the dashboard and the compose helpers (healthcheck, postgres init)
COPY . .

# runs/ (regenerated data, sweeps, checkpoints) and the caches are volumes in docker-compose.yml
RUN mkdir -p /app/runs /cache/huggingface /cache/domino-lab

CMD ["python", "-m", "domino_lab.sweep", "--help"]
