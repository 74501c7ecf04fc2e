#!/usr/bin/env bash
# Prints the Debian mirror that `deploy/images/build.sh base` debootstraps SUITE from:
#
#   deploy/images/debian-mirror.sh SUITE        e.g. deploy/images/debian-mirror.sh bookworm
#
# 1. DEBIAN_MIRROR, when set: the override (a mirror URI, e.g. one this host does not use itself);
# 2. else the host's own apt sources, in apt's order: sources.list, then every *.list and
#    *.sources of sources.list.d/ (one-line and deb822 formats; disabled entries, deb-src and
#    comments skipped), all under APT_ETC (default /etc/apt): the URI of the first `deb` source
#    whose suites include SUITE;
# 3. else, on a Debian host (ID=debian in OS_RELEASE, default /etc/os-release), the URI of the
#    first `deb` source of the host's own release (its VERSION_CODENAME): a Debian mirror serves
#    the other releases too.
# Only http, https and file URIs count. A host behind a company mirror thus needs no setting.
# Nothing found: says what it looked for and exits 1.
set -euo pipefail

LOG_PREFIX=debian-mirror:
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

(($# == 1)) || { log "usage: $0 SUITE"; exit 2; }
suite="$1"
if [[ -n "${DEBIAN_MIRROR:-}" ]]; then
  printf '%s\n' "$DEBIAN_MIRROR"
  exit 0
fi
APT_ETC="${APT_ETC:-/etc/apt}"
OS_RELEASE="${OS_RELEASE:-/etc/os-release}"

files=()
[[ -f "$APT_ETC/sources.list" ]] && files+=("$APT_ETC/sources.list")
for file in "$APT_ETC"/sources.list.d/*; do
  [[ -f "$file" && ("$file" == *.list || "$file" == *.sources) ]] && files+=("$file")
done

# "URI SUITE" of every enabled deb source, in order.
sources() {
  ((${#files[@]} > 0)) || return 0
  awk '
    function flush(   nt, nu, ns, i, j, k, t, u, s) {
      if (tolower(field["enabled"]) !~ /^[ \t]*no[ \t]*$/) {
        nt = split(field["types"], t); nu = split(field["uris"], u); ns = split(field["suites"], s)
        for (i = 1; i <= nt; i++) if (t[i] == "deb")
          for (j = 1; j <= nu; j++) for (k = 1; k <= ns; k++) print u[j], s[k]
      }
      split("", field); key = ""
    }
    FNR == 1 { flush() }
    FILENAME !~ /\.sources$/ {
      sub(/#.*/, "")
      gsub(/\[[^]]*\]/, " ")
      if ($1 == "deb" && NF >= 3) print $2, $3
      next
    }
    /^#/ { next }
    /^[ \t]*$/ { flush(); next }
    /^[ \t]/ { if (key != "") field[key] = field[key] " " $0; next }
    /:/ {
      key = tolower(substr($0, 1, index($0, ":") - 1))
      field[key] = substr($0, index($0, ":") + 1)
    }
    END { flush() }
  ' "${files[@]}"
}

# The URI of the first source that serves suite $1.
uri_for() {
  awk -v suite="$1" '$2 == suite && $1 ~ /^(https?|file):/ { print $1; exit }' <<<"$all"
}

all="$(sources)"
mirror="$(uri_for "$suite")"
if [[ -z "$mirror" ]]; then
  host_release="$(
    # shellcheck source=/dev/null
    source "$OS_RELEASE" 2>/dev/null && [[ "${ID:-}" == debian ]] &&
      printf '%s' "${VERSION_CODENAME:-}"
  )" || true
  [[ -z "$host_release" ]] || mirror="$(uri_for "$host_release")"
fi
[[ -n "$mirror" ]] || die "no apt source in $APT_ETC serves $suite" \
  "(nor, on a Debian host, its own release); set DEBIAN_MIRROR to a Debian mirror"
printf '%s\n' "$mirror"
