# Apache Kafka 4.x (KRaft) for sites without a registry (deploy/images/build.sh): the jars that
# streamproc.tools.kafka_local resolves from Maven Central (kafka_2.13 + kafka-tools) on Debian's
# OpenJDK 17 JRE, configured like the apache/kafka image: every KAFKA_FOO_BAR variable becomes the
# broker property foo.bar (`__` -> `_`, `___` -> `-`), CLUSTER_ID formats the storage on first
# start, and /opt/kafka/bin holds the usual *.sh tools.
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
COPY libs/ /opt/kafka/libs/
COPY config/ /opt/kafka/config/
COPY bin/ /opt/kafka/bin/
ENV PATH=/opt/kafka/bin:$PATH
USER 1000:1000
EXPOSE 9092
ENTRYPOINT ["/opt/kafka/bin/kafka-docker-run"]
