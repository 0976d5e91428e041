#!/usr/bin/env bash
# Install what the docker tier needs: the Docker engine (docker.io), docker-compose (v1) and
# debootstrap (to make a Debian base image where no registry can be reached). Debian/Ubuntu,
# as root. Safe to run again: it installs only what is missing.
set -euo pipefail
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-docker.sh: ${missing[*]} missing; installing them needs root (apt-get)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
