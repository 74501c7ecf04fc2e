{{/* Chart name, overridable. */}}
{{- define "streamproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name; 52 characters leave room for StatefulSet pod suffixes. */}}
{{- define "streamproc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "streamproc.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kubernetes recommended labels. */}}
{{- define "streamproc.labels" -}}
helm.sh/chart: {{ include "streamproc.chart" . }}
{{ include "streamproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: consumer
app.kubernetes.io/part-of: streamproc
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "streamproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "streamproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "streamproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "streamproc.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "streamproc.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- $suffix := ternary .Values.gpu.imageTagSuffix "" .Values.gpu.enabled -}}
{{- printf "%s:%s" $image.repository (default (printf "%s%s" .Chart.AppVersion $suffix) $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* True (non-empty) when an autoscaler owns the replica count. */}}
{{- define "streamproc.autoscaled" -}}
{{- if or .Values.keda.enabled .Values.autoscaling.enabled -}}true{{- end -}}
{{- end -}}

{{/* librdkafka security settings derived from kafkaAuth (no secret values). */}}
{{- define "streamproc.kafkaSecurity" -}}
{{- $sasl := .Values.kafkaAuth.sasl -}}
{{- $tls := .Values.kafkaAuth.tls -}}
{{- if or $sasl.enabled $tls.enabled -}}
security.protocol: {{ ternary (ternary "SASL_SSL" "SASL_PLAINTEXT" $tls.enabled) "SSL" $sasl.enabled }}
{{- end }}
{{- if $sasl.enabled }}
sasl.mechanism: {{ $sasl.mechanism }}
{{- end }}
{{- if $tls.enabled }}
ssl.ca.location: /etc/streamproc/tls/{{ $tls.caKey }}
{{- if $tls.certKey }}
ssl.certificate.location: /etc/streamproc/tls/{{ $tls.certKey }}
{{- end }}
{{- if $tls.keyKey }}
ssl.key.location: /etc/streamproc/tls/{{ $tls.keyKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The config file: .Values.config plus the derived settings above. */}}
{{- define "streamproc.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $kafka := deepCopy (default dict $config.kafka) -}}
{{- /* a key set to null (helm's way to remove one a values file sets) is left out */ -}}
{{- range $key, $value := $kafka -}}
{{- if kindIs "invalid" $value -}}{{- $_ := unset $kafka $key -}}{{- end -}}
{{- end -}}
{{- if eq .Values.groupType "share" -}}
{{- $_ := set $kafka "group_type" "share" -}}
{{- /* consumer-group keys a share group refuses (the values' defaults set group_protocol) */ -}}
{{- $_ := unset $kafka "group_protocol" -}}
{{- $_ := unset $kafka "session_timeout_ms" -}}
{{- end -}}
{{- $security := include "streamproc.kafkaSecurity" . | fromYaml -}}
{{- $_ := set $kafka "consumer" (mergeOverwrite (deepCopy $security) (default dict $kafka.consumer)) -}}
{{- $_ := set $kafka "producer" (mergeOverwrite (deepCopy $security) (default dict $kafka.producer)) -}}
{{- $_ := set $config "kafka" $kafka -}}
{{- $registryTls := .Values.schemaRegistryAuth.tls -}}
{{- if $registryTls.enabled -}}
{{- $registry := deepCopy (default dict $config.schema_registry) -}}
{{- $tlsPaths := dict "ssl_ca_location" (printf "/etc/streamproc/registry-tls/%s" $registryTls.caKey) -}}
{{- if $registryTls.certKey -}}
{{- $_ := set $tlsPaths "ssl_certificate_location" (printf "/etc/streamproc/registry-tls/%s" $registryTls.certKey) -}}
{{- end -}}
{{- if $registryTls.keyKey -}}
{{- $_ := set $tlsPaths "ssl_key_location" (printf "/etc/streamproc/registry-tls/%s" $registryTls.keyKey) -}}
{{- end -}}
{{- $_ := set $config "schema_registry" (mergeOverwrite $tlsPaths $registry) -}}
{{- end -}}
{{- if .Values.gpu.enabled -}}
{{- $worker := deepCopy (default dict $config.worker) -}}
{{- if eq (default "auto" $worker.device) "auto" -}}
{{- $_ := set $worker "device" "cuda" -}}
{{- end -}}
{{- $_ := set $config "worker" $worker -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* True (non-empty) when secrets are merged into the config by the init container. */}}
{{- define "streamproc.secretsInConfig" -}}
{{- if or .Values.kafkaAuth.sasl.enabled .Values.schemaRegistryAuth.basicAuth.enabled -}}true{{- end -}}
{{- end -}}

{{/* Path of the config file the process reads. */}}
{{- define "streamproc.configPath" -}}
{{- if include "streamproc.secretsInConfig" . -}}/run/streamproc/config.yaml{{- else -}}/etc/streamproc/config.yaml{{- end -}}
{{- end -}}

{{/* The source of the model repository volume: existingClaim, nfs, hostPath, or empty. */}}
{{- define "streamproc.modelRepository" -}}
{{- $repo := default dict .Values.models.repository -}}
{{- $nfs := default dict $repo.nfs -}}
{{- if $repo.existingClaim -}}existingClaim
{{- else if or $nfs.server $nfs.path -}}nfs
{{- else if $repo.hostPath -}}hostPath
{{- end -}}
{{- end -}}

{{- define "streamproc.metricsPort" -}}
{{- $metrics := default dict .Values.config.metrics -}}
{{- if and (hasKey $metrics "port") (not (kindIs "invalid" $metrics.port)) -}}
{{- int $metrics.port -}}
{{- else -}}
9108
{{- end -}}
{{- end -}}

{{/* Refuses inconsistent values; included by every workload template. */}}
{{- define "streamproc.validate" -}}
{{- $config := .Values.config -}}
{{- $kind := .Values.workload.kind -}}
{{- if not (has $kind (list "Deployment" "StatefulSet")) -}}
{{- fail (printf "workload.kind must be Deployment or StatefulSet, got %q" $kind) -}}
{{- end -}}
{{- if not $config.pipelines -}}
{{- fail "config.pipelines: at least one pipeline is required" -}}
{{- end -}}
{{- $shutdown := float64 (default 30 $config.shutdown_timeout_s) -}}
{{- if le (float64 .Values.terminationGracePeriodSeconds) $shutdown -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be greater than config.shutdown_timeout_s (%v): the pod would be killed before it drains, flushes and commits" .Values.terminationGracePeriodSeconds $shutdown) -}}
{{- end -}}
{{- if and (eq (default "at_least_once" $config.processing_guarantee) "exactly_once") (ne $kind "StatefulSet") -}}
{{- fail "config.processing_guarantee exactly_once needs workload.kind StatefulSet (stable pod names for Kafka transactional ids)" -}}
{{- end -}}
{{- if and .Values.staticMembership (ne $kind "StatefulSet") -}}
{{- fail "staticMembership needs workload.kind StatefulSet (stable pod names: the group instance ids)" -}}
{{- end -}}
{{- $kafka := default dict $config.kafka -}}
{{- if and (hasKey $kafka "group_type") (ne (toString $kafka.group_type) .Values.groupType) -}}
{{- fail (printf "config.kafka.group_type: set groupType instead (it is rendered into the config), got %v" $kafka.group_type) -}}
{{- end -}}
{{- if eq .Values.groupType "share" -}}
{{- if .Values.staticMembership -}}
{{- fail "groupType share: staticMembership is a consumer-group setting (a share group has no assignment to keep); remove it" -}}
{{- end -}}
{{- if eq (default "at_least_once" $config.processing_guarantee) "exactly_once" -}}
{{- fail "groupType share: config.processing_guarantee exactly_once is not supported (a share group acknowledges records one by one, outside transactions); use at_least_once" -}}
{{- end -}}
{{- if and .Values.keda.enabled (not .Values.keda.share.prometheusAddress) -}}
{{- fail "groupType share: keda.enabled needs keda.share.prometheusAddress (a share group has no lag KEDA's kafka scaler can read; the chart scales on streamproc_share_busy_ratio through KEDA's prometheus scaler)" -}}
{{- end -}}
{{- if and .Values.keda.enabled (lt (int .Values.keda.minReplicaCount) 1) -}}
{{- fail "groupType share: keda.minReplicaCount must be at least 1 (the scaling gauge comes from the pods: with none, nothing would ever scale up)" -}}
{{- end -}}
{{- end -}}
{{- if and (eq (default "classic" $kafka.group_protocol) "consumer") (not (kindIs "invalid" $kafka.session_timeout_ms)) -}}
{{- fail "config.kafka.session_timeout_ms is not supported with config.kafka.group_protocol consumer (the broker's group.consumer.session.timeout.ms applies): remove it" -}}
{{- end -}}
{{- if eq (include "streamproc.metricsPort" .) "0" -}}
{{- fail "config.metrics.port must not be 0 in Kubernetes: the probes use /healthz and /readyz on it" -}}
{{- end -}}
{{- if and .Values.gpu.enabled (eq (default "auto" ((default dict $config.worker).device)) "cpu") -}}
{{- fail "gpu.enabled is true but config.worker.device is cpu" -}}
{{- end -}}
{{- $kafka := default dict $config.kafka -}}
{{- range $client := list "consumer" "producer" -}}
{{- range $key, $_ := (default dict (get $kafka $client)) -}}
{{- if regexMatch "(password|secret|jaas|^ssl\\.key\\.pem$)" $key -}}
{{- fail (printf "config.kafka.%s.%s looks like a credential: it would end up in a ConfigMap; use kafkaAuth with an existing Secret" $client $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.kafkaAuth.sasl.enabled (not .Values.kafkaAuth.sasl.existingSecret) -}}
{{- fail "kafkaAuth.sasl.enabled needs kafkaAuth.sasl.existingSecret" -}}
{{- end -}}
{{- if and .Values.kafkaAuth.tls.enabled (not .Values.kafkaAuth.tls.existingSecret) -}}
{{- fail "kafkaAuth.tls.enabled needs kafkaAuth.tls.existingSecret" -}}
{{- end -}}
{{- if and .Values.schemaRegistryAuth.basicAuth.enabled (not .Values.schemaRegistryAuth.basicAuth.existingSecret) -}}
{{- fail "schemaRegistryAuth.basicAuth.enabled needs schemaRegistryAuth.basicAuth.existingSecret" -}}
{{- end -}}
{{- if and .Values.schemaRegistryAuth.tls.enabled (not .Values.schemaRegistryAuth.tls.existingSecret) -}}
{{- fail "schemaRegistryAuth.tls.enabled needs schemaRegistryAuth.tls.existingSecret" -}}
{{- end -}}
{{- if hasKey (default dict .Values.config.schema_registry) "basic_auth_user_info" -}}
{{- fail "config.schema_registry.basic_auth_user_info: a secret in the ConfigMap; use schemaRegistryAuth.basicAuth.existingSecret" -}}
{{- end -}}
{{- if and .Values.keda.enabled (not $kafka.bootstrap_servers) -}}
{{- fail "keda.enabled needs config.kafka.bootstrap_servers (the scaler connects to the brokers)" -}}
{{- end -}}
{{- include "streamproc.validateModels" . -}}
{{- end -}}

{{/* Refuses inconsistent models / admin values (part of streamproc.validate). */}}
{{- define "streamproc.validateModels" -}}
{{- $admin := default dict .Values.config.admin -}}
{{- if and (hasKey $admin "token") (not (kindIs "invalid" $admin.token)) -}}
{{- fail "config.admin.token: a secret in the ConfigMap; put the token in a Secret and name it in admin.existingSecret (the pod gets it as STREAMPROC_ADMIN_TOKEN)" -}}
{{- end -}}
{{- $tracing := default dict .Values.config.tracing -}}
{{- if and (hasKey $tracing "headers") (not (kindIs "invalid" $tracing.headers)) -}}
{{- fail "config.tracing.headers: a secret in the ConfigMap; put the headers (JSON) in a Secret and name it in tracing.existingSecret (the pod gets them as STREAMPROC_TRACING__HEADERS)" -}}
{{- end -}}
{{- if and .Values.tracing.existingSecret (not .Values.tracing.headersKey) -}}
{{- fail "tracing.existingSecret needs tracing.headersKey (the Secret's key holding the headers as JSON)" -}}
{{- end -}}
{{- if and .Values.tracing.existingSecret (not .Values.tracing.endpoint) (not $tracing.endpoint) -}}
{{- fail "tracing.existingSecret needs tracing.endpoint (or config.tracing.endpoint): headers for no collector" -}}
{{- end -}}
{{- if and .Values.admin.existingSecret (not .Values.admin.secretKey) -}}
{{- fail "admin.existingSecret needs admin.secretKey (the Secret's key holding the token)" -}}
{{- end -}}
{{- $repo := default dict .Values.models.repository -}}
{{- $nfs := default dict $repo.nfs -}}
{{- $sources := list -}}
{{- if $repo.existingClaim -}}{{- $sources = append $sources "existingClaim" -}}{{- end -}}
{{- if or $nfs.server $nfs.path -}}{{- $sources = append $sources "nfs" -}}{{- end -}}
{{- if $repo.hostPath -}}{{- $sources = append $sources "hostPath" -}}{{- end -}}
{{- if gt (len $sources) 1 -}}
{{- fail (printf "models.repository: set only one of existingClaim, nfs, hostPath (got %s)" (join ", " $sources)) -}}
{{- end -}}
{{- if and (or $nfs.server $nfs.path) (not (and $nfs.server $nfs.path)) -}}
{{- fail "models.repository.nfs needs both server and path" -}}
{{- end -}}
{{- $mlflow := default dict .Values.models.mlflow -}}
{{- $anyKey := or $mlflow.tokenKey $mlflow.usernameKey $mlflow.passwordKey -}}
{{- if and $mlflow.existingSecret (not $anyKey) -}}
{{- fail "models.mlflow.existingSecret needs tokenKey, or usernameKey and passwordKey (the Secret's keys)" -}}
{{- end -}}
{{- if and $anyKey (not $mlflow.existingSecret) -}}
{{- fail "models.mlflow.tokenKey / usernameKey / passwordKey need models.mlflow.existingSecret" -}}
{{- end -}}
{{- if and $mlflow.tokenKey (or $mlflow.usernameKey $mlflow.passwordKey) -}}
{{- fail "models.mlflow: set tokenKey or usernameKey and passwordKey, not both" -}}
{{- end -}}
{{- if and (or $mlflow.usernameKey $mlflow.passwordKey) (not (and $mlflow.usernameKey $mlflow.passwordKey)) -}}
{{- fail "models.mlflow.usernameKey and models.mlflow.passwordKey go together" -}}
{{- end -}}
{{- /* a pipeline's model needs its location: in its config, from the chart, or from extraEnv */ -}}
{{- $env := list -}}
{{- range .Values.extraEnv -}}{{- $env = append $env .name -}}{{- end -}}
{{- $hasRepository := or (include "streamproc.modelRepository" .) (has "STREAMPROC_MODEL_REPOSITORY" $env) -}}
{{- $hasTracking := or $mlflow.trackingUri (has "MLFLOW_TRACKING_URI" $env) -}}
{{- range $i, $pipeline := .Values.config.pipelines -}}
{{- $model := $pipeline.model -}}
{{- if kindIs "map" $model -}}
{{- $source := default "folder" $model.source -}}
{{- if and (eq $source "folder") (not $model.repository) (not $hasRepository) -}}
{{- fail (printf "config.pipelines[%d] (%s): model.source folder needs model.repository, or models.repository (a volume mounted at models.mountPath)" $i $pipeline.name) -}}
{{- end -}}
{{- if and (eq $source "mlflow") (not $model.tracking_uri) (not $hasTracking) -}}
{{- fail (printf "config.pipelines[%d] (%s): model.source mlflow needs model.tracking_uri or models.mlflow.trackingUri" $i $pipeline.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The pod template shared by the Deployment and the StatefulSet. */}}
{{- define "streamproc.podTemplate" -}}
{{- $sasl := .Values.kafkaAuth.sasl -}}
{{- $tls := .Values.kafkaAuth.tls -}}
{{- $registryAuth := .Values.schemaRegistryAuth.basicAuth -}}
{{- $gpu := .Values.gpu -}}
{{- $modelRepository := include "streamproc.modelRepository" . -}}
{{- $mlflow := default dict .Values.models.mlflow -}}
metadata:
  labels:
    {{- include "streamproc.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: consumer
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "streamproc.config" . | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "streamproc.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  terminationGracePeriodSeconds: {{ int .Values.terminationGracePeriodSeconds }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if and $gpu.enabled $gpu.runtimeClassName }}
  runtimeClassName: {{ $gpu.runtimeClassName }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- $nodeSelector := deepCopy .Values.nodeSelector }}
  {{- if $gpu.enabled }}
  {{- $nodeSelector = mergeOverwrite $nodeSelector (deepCopy $gpu.nodeSelector) }}
  {{- end }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := .Values.tolerations }}
  {{- if $gpu.enabled }}
  {{- $tolerations = concat $tolerations $gpu.tolerations }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or $sasl.enabled $registryAuth.enabled }}
  initContainers:
    # Merges the credentials (Secret files: Kafka SASL, the Schema Registry's user info) into the
    # config, in a memory-backed volume.
    - name: render-config
      image: {{ include "streamproc.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["streamproc-render-config"]
      args:
        - --in=/etc/streamproc/config.yaml
        - --out=/run/streamproc/config.yaml
        {{- if $sasl.enabled }}
        {{- range $client := list "consumer" "producer" }}
        - --secret=kafka/{{ $client }}/sasl.username=/var/run/secrets/streamproc/sasl/username
        - --secret=kafka/{{ $client }}/sasl.password=/var/run/secrets/streamproc/sasl/password
        {{- end }}
        {{- end }}
        {{- if $registryAuth.enabled }}
        - --secret=schema_registry/basic_auth_user_info=/var/run/secrets/streamproc/registry/user-info
        {{- end }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
        limits:
          memory: 128Mi
      volumeMounts:
        - name: config
          mountPath: /etc/streamproc/config.yaml
          subPath: config.yaml
          readOnly: true
        - name: rendered-config
          mountPath: /run/streamproc
        {{- if $sasl.enabled }}
        - name: sasl
          mountPath: /var/run/secrets/streamproc/sasl
          readOnly: true
        {{- end }}
        {{- if $registryAuth.enabled }}
        - name: registry-auth
          mountPath: /var/run/secrets/streamproc/registry
          readOnly: true
        {{- end }}
  {{- end }}
  containers:
    - name: streamproc
      image: {{ include "streamproc.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: ["run", "--config", "{{ include "streamproc.configPath" . }}"]
      env:
        - name: STREAMPROC_CONFIG
          value: {{ include "streamproc.configPath" . }}
        # Stable per pod with a StatefulSet (<name>-0, -1, ...): the base of exactly-once
        # transactional ids.
        - name: STREAMPROC_INSTANCE_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- if .Values.staticMembership }}
        # Static membership: the StatefulSet pod name is the group instance id.
        - name: STREAMPROC_KAFKA__GROUP_INSTANCE_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- end }}
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        {{- if $modelRepository }}
        # The default repository of pipelines with model.source folder (read-only volume).
        - name: STREAMPROC_MODEL_REPOSITORY
          value: {{ .Values.models.mountPath | quote }}
        {{- end }}
        {{- with $mlflow.trackingUri }}
        - name: MLFLOW_TRACKING_URI
          value: {{ . | quote }}
        {{- end }}
        {{- if $mlflow.existingSecret }}
        # The MLflow client reads its credentials from these variables only.
        {{- range $name, $key := dict "MLFLOW_TRACKING_TOKEN" $mlflow.tokenKey "MLFLOW_TRACKING_USERNAME" $mlflow.usernameKey "MLFLOW_TRACKING_PASSWORD" $mlflow.passwordKey }}
        {{- if $key }}
        - name: {{ $name }}
          valueFrom:
            secretKeyRef:
              name: {{ $mlflow.existingSecret }}
              key: {{ $key }}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- with .Values.admin.existingSecret }}
        # Bearer token of the admin endpoint (POST /models/<pipeline> on the metrics port).
        - name: STREAMPROC_ADMIN_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.admin.secretKey }}
        {{- end }}
        {{- with .Values.tracing.endpoint }}
        # Tracing: the OTLP/HTTP collector (the default of config.tracing.endpoint).
        - name: OTEL_EXPORTER_OTLP_ENDPOINT
          value: {{ . | quote }}
        {{- end }}
        {{- if .Values.tracing.existingSecret }}
        # The trace export's headers (JSON), e.g. an API key: never in the ConfigMap.
        - name: STREAMPROC_TRACING__HEADERS
          valueFrom:
            secretKeyRef:
              name: {{ .Values.tracing.existingSecret }}
              key: {{ .Values.tracing.headersKey }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http-metrics
          containerPort: {{ include "streamproc.metricsPort" . }}
          protocol: TCP
      startupProbe:
        httpGet:
          path: /healthz
          port: http-metrics
        {{- toYaml .Values.probes.startup | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: http-metrics
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: http-metrics
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      {{- $resources := deepCopy (default dict .Values.resources) }}
      {{- if $gpu.enabled }}
      {{- $limits := default dict $resources.limits }}
      {{- $_ := set $limits $gpu.resourceName (int $gpu.count) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/streamproc/config.yaml
          subPath: config.yaml
          readOnly: true
        - name: tmp
          mountPath: /tmp
        - name: dshm
          mountPath: /dev/shm
        {{- if or $sasl.enabled $registryAuth.enabled }}
        - name: rendered-config
          mountPath: /run/streamproc
          readOnly: true
        {{- end }}
        {{- if $tls.enabled }}
        - name: tls
          mountPath: /etc/streamproc/tls
          readOnly: true
        {{- end }}
        {{- if .Values.schemaRegistryAuth.tls.enabled }}
        - name: registry-tls
          mountPath: /etc/streamproc/registry-tls
          readOnly: true
        {{- end }}
        {{- if $modelRepository }}
        # New versions appear here while the pod runs (no restart); the process never writes.
        - name: model-repository
          mountPath: {{ .Values.models.mountPath }}
          readOnly: true
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "streamproc.fullname" . }}
    - name: tmp
      emptyDir:
        {{- with .Values.tmp.medium }}
        medium: {{ . }}
        {{- end }}
        {{- with .Values.tmp.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    # POSIX shared memory: the staging slabs of worker.decode_mode "process" live here (the
    # runtime's default /dev/shm is 64 MiB).
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.sharedMemory.sizeLimit }}
    {{- if or $sasl.enabled $registryAuth.enabled }}
    - name: rendered-config
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
    {{- end }}
    {{- if $registryAuth.enabled }}
    - name: registry-auth
      secret:
        secretName: {{ $registryAuth.existingSecret }}
        defaultMode: 0440
        items:
          - key: {{ $registryAuth.userInfoKey }}
            path: user-info
    {{- end }}
    {{- if $sasl.enabled }}
    - name: sasl
      secret:
        secretName: {{ $sasl.existingSecret }}
        defaultMode: 0440
        items:
          - key: {{ $sasl.usernameKey }}
            path: username
          - key: {{ $sasl.passwordKey }}
            path: password
    {{- end }}
    {{- if $tls.enabled }}
    - name: tls
      secret:
        secretName: {{ $tls.existingSecret }}
        defaultMode: 0440
    {{- end }}
    {{- if .Values.schemaRegistryAuth.tls.enabled }}
    - name: registry-tls
      secret:
        secretName: {{ .Values.schemaRegistryAuth.tls.existingSecret }}
        defaultMode: 0440
    {{- end }}
    {{- if $modelRepository }}
    {{- $repo := .Values.models.repository }}
    - name: model-repository
      {{- if eq $modelRepository "existingClaim" }}
      persistentVolumeClaim:
        claimName: {{ $repo.existingClaim }}
        readOnly: true
      {{- else if eq $modelRepository "nfs" }}
      nfs:
        server: {{ $repo.nfs.server | quote }}
        path: {{ $repo.nfs.path | quote }}
        readOnly: true
      {{- else }}
      # single-node test clusters only
      hostPath:
        path: {{ $repo.hostPath | quote }}
        type: Directory
      {{- end }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
