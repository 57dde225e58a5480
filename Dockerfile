# qkwatch in a container (docker-compose.yml builds both targets).
#
#   collector  the collector and the CLI: qkwatch serve, db upgrade, token create, dashboards push
#   trainer    the collector image plus a CPU build of PyTorch: qkwatch train (the demo profile)
#
#   docker build --target collector -t qkwatch .
#   docker build --target trainer --build-arg TORCH='torch --index-url https://download.pytorch.org/whl/cu128' .
FROM python:3.11-slim AS collector
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/qkwatch
COPY pyproject.toml README.md ./
COPY qkwatch qkwatch
RUN pip install '.[collector,postgres,grafana]' \
    && useradd --system --create-home --uid 10001 qkwatch \
    && mkdir -p /work/runs && chown -R qkwatch /work
USER qkwatch
WORKDIR /work
EXPOSE 8000
# Migrate, then serve (serve migrates too; doing it first makes a failed migration the container's exit).
CMD ["sh", "-c", "qkwatch db upgrade && exec qkwatch serve --host 0.0.0.0 --port 8000"]

FROM collector AS trainer
USER root
ARG TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
RUN pip install $TORCH && pip install '/opt/qkwatch[torch]'
USER qkwatch
CMD ["qkwatch", "train", "--list"]
