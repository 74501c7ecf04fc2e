# Zipkin 3.6.1 (the trace store, its query API and UI) for sites without a registry
# (deploy/images/build.sh zipkin): the executable jar that streamproc.tools.tracing_local
# resolves from Maven Central, on Debian's OpenJDK 17 JRE (the same first layer as the Kafka
# image). In-memory storage; its transport collectors (Kafka, RabbitMQ, ActiveMQ, Scribe) off:
# spans arrive over HTTP from the OpenTelemetry Collector. Used by docker-compose.yml through
# ZIPKIN_IMAGE.
ARG DEBIAN_IMAGE=streamproc/debian:bookworm
FROM ${DEBIAN_IMAGE}
# man1 must exist for the JRE's update-alternatives (the base leaves out man pages).
# hadolint ignore=DL3008
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 1000 appuser \
 && useradd --system --uid 1000 --gid 1000 --home-dir /home/appuser --create-home appuser \
 && install -d -o appuser -g appuser /var/lib/kafka/data /opt/kafka/config
COPY zipkin.jar /opt/zipkin/zipkin.jar
ENV STORAGE_TYPE=mem SELF_TRACING_ENABLED=false COLLECTOR_KAFKA_ENABLED=false \
    COLLECTOR_RABBITMQ_ENABLED=false COLLECTOR_ACTIVEMQ_ENABLED=false COLLECTOR_SCRIBE_ENABLED=false
USER 1000:1000
WORKDIR /tmp
EXPOSE 9411
ENTRYPOINT ["java", "-jar", "/opt/zipkin/zipkin.jar"]
