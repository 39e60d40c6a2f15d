#!/usr/bin/env bash
# Installs the system packages rlstream needs when they are missing: a JDK (Kafka), Maven (to
# fetch Kafka from Maven Central once), Go (to build Toxiproxy once, the WAN between regions), kcat
# (interop test) and Chromium (dashboard test). Debian/Ubuntu only; needs root.
set -euo pipefail
need=()
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v go >/dev/null || [[ -x /usr/local/go/bin/go ]] || need+=(golang-go)
command -v kcat >/dev/null || need+=(kcat)
[[ -x /usr/bin/chromium ]] || need+=(chromium)  # the dashboard's browser test
((${#need[@]})) || exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "rlstream: please install: ${need[*]} (no root or no apt-get here; kcat is optional)" >&2
  command -v java >/dev/null && command -v mvn >/dev/null && exit 0
  exit 1
fi
echo "rlstream: installing ${need[*]} ..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
