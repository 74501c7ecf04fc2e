# The OpenTelemetry Collector v0.148.0 (OTLP in over HTTP and gRPC, the batch processor, the
# Zipkin exporter) for sites without a registry (deploy/images/build.sh otelcol): the static
# binary that streamproc.tools.tracing_local builds once with the Collector Builder from the Go
# module proxy. Its config is mounted (deploy/compose/otel-collector.yaml). Used by
# docker-compose.yml through OTEL_COLLECTOR_IMAGE; the entrypoint takes the official image's
# arguments (--config=...).
ARG DEBIAN_IMAGE=streamproc/debian:bookworm
FROM ${DEBIAN_IMAGE}
COPY otelcol /usr/local/bin/otelcol
USER 10001:10001
EXPOSE 4317 4318
ENTRYPOINT ["/usr/local/bin/otelcol"]
