#!/usr/bin/env bash
# Lints and validates every deployment artefact offline (`make lint-deploy`):
#   hadolint (Dockerfile), shellcheck (every shell script: deploy/shellcheck.sh), the Compose
#   files against the Compose Specification schema (+ referenced files exist), and for every
#   values file in deploy/helm/ci: `helm lint --strict` and `helm template | kubeconform -strict`
#   for each Kubernetes version in KUBE_VERSIONS (oldest the chart supports and newest with
#   bundled schemas), CRDs included.
# tests/deploy runs the same checks plus assertions on the rendered manifests.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
KUBE_VERSIONS="${KUBE_VERSIONS:-1.27.0 1.37.0}"
CHART=deploy/helm/streamproc

# shellcheck source=/dev/null
source "$(deploy/tools.sh)"

run() {
  printf '\n$ %s\n' "$*"
  "$@"
}

run "$HADOLINT" Dockerfile
echo "hadolint: Dockerfile clean"
SHELLCHECK="$SHELLCHECK" run deploy/shellcheck.sh
echo "shellcheck: clean"
run "$TOOLS_PYTHON" deploy/validate_compose.py --schema "$COMPOSE_SCHEMA" \
  docker-compose.yml deploy/compose/docker-compose.gpu.yml

for values in deploy/helm/ci/*.yaml; do
  for kube in $KUBE_VERSIONS; do
    run "$HELM" lint --strict "$CHART" --values "$values" --kube-version "$kube"
    printf '\n$ helm template ci %s --values %s --kube-version %s | kubeconform -strict\n' \
      "$CHART" "$values" "$kube"
    "$HELM" template ci "$CHART" --values "$values" --kube-version "$kube" |
      "$KUBECONFORM" -strict -summary -kubernetes-version "$kube" \
        -schema-location "$K8S_SCHEMAS/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
        -schema-location "$CRD_SCHEMAS/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json"
  done
done
printf '\nlint-deploy: all checks passed\n'
