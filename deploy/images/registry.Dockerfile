# Apicurio Registry 2.6 (in-memory storage; the Confluent-compatible API under /apis/ccompat/v7)
# for sites without a registry (deploy/images/build.sh registry): the application that
# streamproc.tools.registry_local resolves from Maven Central, on Debian's OpenJDK 17 JRE (the
# same first layer as the Kafka image, so the JRE is installed once). BACKWARD compatibility by
# default (REGISTRY_COMPATIBILITY overrides it).
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
COPY app/ /opt/apicurio/
COPY registry-run /usr/local/bin/registry-run
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/registry-run"]
