# kvxferd container image. CPU torch: enough for shared-memory regions and the
# tcp transport; mapping CUDA IPC regions needs an image built on a CUDA torch.
#
#   docker build -t kvxferd .
#   docker run --rm -v /run/kvxferd:/run/kvxferd -v /dev/shm:/dev/shm \
#     -p 5557:5557 -p 5558:5558 -p 9400:9400 \
#     -v /etc/kvxferd:/etc/kvxferd:ro kvxferd serve --config /etc/kvxferd/kvxferd.toml
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU torch first, from the PyTorch CPU index, so the dependency range in
# pyproject.toml is already satisfied and never pulls a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvxferd ./kvxferd
# the package build compiles the native run copy (hashing with the xxhash header), then the
# compiler goes: the hashing is compiled in, nothing of libxxhash is needed at run time
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev \
 && pip install . \
 && apt-get purge -y gcc libc6-dev libxxhash-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && rm -rf /src

# example daemon configs (kvxferd.toml: every setting) and instance geometries for `kvxferd plan`
COPY configs /usr/share/kvxferd/configs

RUN groupadd --system --gid 10001 kvxferd \
 && useradd --system --uid 10001 --gid kvxferd --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin kvxferd \
 && install -d -o kvxferd -g kvxferd -m 0750 /run/kvxferd

# The engine IPC socket lives here (engine.sock, unless engine.socket_path says
# otherwise); share this directory with the engines. RUNTIME_DIRECTORY is what
# systemd's RuntimeDirectory= sets: `serve` binds there and `kvxferd status`
# (e.g. through `docker exec`) looks there. KVXFERD_<SECTION>_<KEY> variables
# override the config file: the peer and metrics endpoints listen on all
# interfaces so the published ports answer.
ENV RUNTIME_DIRECTORY=/run/kvxferd \
    KVXFERD_PEER_BIND_HOST=0.0.0.0 \
    KVXFERD_METRICS_BIND=0.0.0.0:9400 \
    KVXFERD_DAEMON_LOG_FORMAT=logfmt
VOLUME ["/run/kvxferd"]

# 5557: peer control (ZeroMQ tcp), 5558: tcp data transport, 9400: Prometheus metrics + health
EXPOSE 5557 5558 9400

USER 10001:10001
WORKDIR /run/kvxferd

HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=4)"]

# SIGTERM drains in-flight transfers (up to timeouts.drain_grace_s); give
# `docker stop` a longer grace period, e.g. `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvxferd"]
CMD ["serve"]
