# Prometheus (and promtool) from Debian's `prometheus` package, for sites without a registry
# (deploy/images/build.sh). Used by docker-compose.yml through PROMETHEUS_IMAGE.
ARG DEBIAN_IMAGE=streamproc/debian:bookworm
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o 65534 -g 65534 /prometheus \
 && prometheus --version && promtool --version
# nobody, as the official prom/prometheus image
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
