# Python base of the streamproc image where no registry is reachable: Debian's python3.11 on the
# debootstrap base (deploy/images/build.sh). Same role as python:3.11-slim-bookworm.
ARG DEBIAN_IMAGE=streamproc/debian:bookworm
FROM ${DEBIAN_IMAGE}
# The suite (bookworm) pins the versions; its point releases bring only security fixes.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python \
 && python --version
CMD ["python3"]
