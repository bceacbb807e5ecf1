{{/* Names, labels and the pieces every role's manifests share. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix; role names are appended, so keep room for them. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Usage: include "tandem.roleName" (dict "root" $ "role" "prefill") */}}
{{- define "tandem.roleName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .role }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* Selector labels of one role: name + instance + component tell the roles
of one release apart. Usage: (dict "root" $ "role" "decode") */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "tandem.roleLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* In-cluster addresses (host:port) of the roles. */}}
{{- define "tandem.kvstoreTarget" -}}
{{- printf "%s:%d" (include "tandem.roleName" (dict "root" . "role" "kvstore")) (int .Values.kvstore.port) }}
{{- end }}

{{- define "tandem.prefillTarget" -}}
{{- if .Values.prefill.enabled }}
{{- printf "%s:%d" (include "tandem.roleName" (dict "root" . "role" "prefill")) (int .Values.prefill.port) }}
{{- end }}
{{- end }}

{{- define "tandem.decodeTarget" -}}
{{- printf "%s:%d" (include "tandem.roleName" (dict "root" . "role" "decode")) (int .Values.decode.port) }}
{{- end }}

{{/* The kvstore's --backend: memory, the chart's Redis, or the user's. */}}
{{- define "tandem.storeBackend" -}}
{{- if and .Values.redis.enabled .Values.redis.url }}
{{- fail "set either redis.enabled (the chart runs Redis) or redis.url (a Redis you run), not both" }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "tandem.roleName" (dict "root" . "role" "redis")) }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else }}
{{- "memory" }}
{{- end }}
{{- end }}

{{/* TANDEM_MODEL for the model source, empty for the embedded default. */}}
{{- define "tandem.modelArg" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "embedded" }}
{{- $m.name }}
{{- else if eq $m.source "image" }}
{{- required "model.source=image needs model.path: the model folder or .gguf file inside the image" $m.path }}
{{- else if eq $m.source "pvc" }}
{{- $_ := required "model.source=pvc needs model.pvc.claimName: the PersistentVolumeClaim holding the model" $m.pvc.claimName }}
{{- if $m.path }}{{ printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) (trimPrefix "/" $m.path) }}{{ else }}{{ $m.pvc.mountPath }}{{ end }}
{{- else if eq $m.source "hub" }}
{{- required "model.source=hub needs model.name: a Hugging Face model id" $m.name }}
{{- else }}
{{- fail (printf "model.source=%q is not one of embedded, image, pvc, hub" $m.source) }}
{{- end }}
{{- end }}

{{/* Env entries from a name -> value map, in a stable order. */}}
{{- define "tandem.envMap" -}}
{{- range $k, $v := . }}
- name: {{ $k }}
  value: {{ toString $v | quote }}
{{- end }}
{{- end }}

{{/* An env value as the flag parses it: Helm reads every number of a values
file as a float, and toString writes a large whole one as 1e+06. */}}
{{- define "tandem.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* The env twins of an engine role's settings (its `engineArgs`, keyed by
EngineArgs field names, as in `tandem serve <role> --help` with underscores),
as YAML of name: value. The chart's own: KV moves through its kvstore.
Usage: include "tandem.engineEnv" (dict "root" $ "role" "decode") | fromYaml */}}
{{- define "tandem.engineEnv" -}}
{{- $args := merge (deepCopy (default dict (get .root.Values .role).engineArgs)) (dict "kv_transfer" "store") }}
{{- if eq (toString $args.kv_transfer) "direct" }}
{{- fail (printf "%s.engineArgs.kv_transfer=direct needs prefill and decode on one host; the chart runs each role in its own pod: use store (the default) or none" .role) }}
{{- end }}
{{- if eq (toString $args.kv_transfer) "store" }}
{{- $args = merge $args (dict "kv_store" (include "tandem.kvstoreTarget" .root)) }}
{{- end }}
{{- $env := dict }}
{{- range $name, $value := $args }}
{{- if kindIs "invalid" $value }}
{{- else if eq $name "enable_prefix_caching" }}
{{- /* the settings whose flags are negations: --no-prefix-caching, --no-kernel-warmup,
--no-piecewise-cuda-graphs */}}
{{- $_ := set $env "TANDEM_NO_PREFIX_CACHING" (toString (not $value)) }}
{{- else if eq $name "kernel_warmup" }}
{{- $_ := set $env "TANDEM_NO_KERNEL_WARMUP" (toString (not $value)) }}
{{- else if eq $name "piecewise_cuda_graphs" }}
{{- $_ := set $env "TANDEM_NO_PIECEWISE_CUDA_GRAPHS" (toString (not $value)) }}
{{- else }}
{{- $_ := set $env (printf "TANDEM_%s" (upper $name)) (include "tandem.envValue" $value) }}
{{- end }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/* Env every role shares: bind address, TLS, model, user env; an engine
role's settings too. A role's `env` wins over its `engineArgs`, which win
over the global `env`. Usage: (dict "root" $ "role" "decode" "model" true "engine" true) */}}
{{- define "tandem.commonEnv" -}}
{{- $v := .root.Values }}
- name: TANDEM_HOST
  value: "0.0.0.0"
{{- if $v.tls.enabled }}
- name: TANDEM_TLS_CERT
  value: /etc/tandem/tls/tls.crt
- name: TANDEM_TLS_KEY
  value: /etc/tandem/tls/tls.key
- name: TANDEM_TLS_CA
  value: /etc/tandem/tls/ca.crt
{{- end }}
{{- if .model }}
{{- $model := include "tandem.modelArg" .root }}
{{- if $model }}
- name: TANDEM_MODEL
  value: {{ $model | quote }}
{{- end }}
{{- if and (eq $v.model.source "hub") $v.model.revision }}
- name: TANDEM_REVISION
  value: {{ $v.model.revision | quote }}
{{- end }}
{{- if and (eq $v.model.source "hub") $v.model.hfTokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $v.model.hfTokenSecret }}
      key: HF_TOKEN
{{- end }}
{{- end }}
{{- $engine := dict }}
{{- if .engine }}
{{- $engine = include "tandem.engineEnv" (dict "root" .root "role" .role) | fromYaml }}
{{- end }}
{{- include "tandem.envMap" (merge (deepCopy (get $v .role).env) $engine $v.env) }}
{{- end }}

{{/* Volumes and mounts for the model PVC and the TLS secret. */}}
{{- define "tandem.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if has .role (list "prefill" "decode") }}
{{- /* The KV mover's staging arena is shared memory (services/kvstore/mover.py);
a container's own /dev/shm is 64 MiB. It counts against the memory limit. */}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .root.Values.sharedMemory.sizeLimit }}
{{- end }}
{{- if and .model (eq .root.Values.model.source "pvc") }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.enabled needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt" .root.Values.tls.secretName }}
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if has .role (list "prefill" "decode") }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- if and .model (eq .root.Values.model.source "pvc") }}
- name: model
  mountPath: {{ .root.Values.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Resources of a role, with its GPUs when gpu.enabled: `gpus`, or one per
tensor-parallel rank (engineArgs.tensor_parallel_size) where that is more. */}}
{{- define "tandem.resources" -}}
{{- $r := deepCopy (default dict .cfg.resources) }}
{{- if and .root.Values.gpu.enabled (gt (int .cfg.gpus) 0) }}
{{- $limits := deepCopy (default dict $r.limits) }}
{{- $ranks := int (default 1 (dig "engineArgs" "tensor_parallel_size" 1 .cfg)) }}
{{- $_ := set $limits .root.Values.gpu.resourceName (toString (max (int .cfg.gpus) $ranks)) }}
{{- $_ := set $r "limits" $limits }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/* Health probes. gRPC roles: Kubernetes' native gRPC probe on the
standard health service (TCP when TLS is on: the probe cannot do TLS). The
startup probe allows a slow model load before liveness counts.
Usage: (dict "root" $ "port" 50061) */}}
{{- define "tandem.grpcProbes" -}}
{{- $check := dict "grpc" (dict "port" (int .port)) }}
{{- if .root.Values.tls.enabled }}
{{- $check = dict "tcpSocket" (dict "port" (int .port)) }}
{{- end }}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 120
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  failureThreshold: 6
{{- end }}

{{/* preStop: keep serving a few seconds after the pod leaves the endpoints,
then SIGTERM starts the drain within terminationGracePeriodSeconds. */}}
{{- define "tandem.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .cfg.preStopSleepSeconds | toString | quote }}]
{{- end }}

{{- define "tandem.scheduling" -}}
{{- $v := .root.Values }}
{{- $gpu := and $v.gpu.enabled (gt (int .cfg.gpus) 0) }}
{{- $nodeSelector := .cfg.nodeSelector }}
{{- $tolerations := .cfg.tolerations }}
{{- if $gpu }}
{{- $nodeSelector = merge (deepCopy (default dict .cfg.nodeSelector)) $v.gpu.nodeSelector }}
{{- $tolerations = concat (default list .cfg.tolerations) (default list $v.gpu.tolerations) }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Label matchers that pick one role's series of this release in PromQL. */}}
{{- define "tandem.promSelector" -}}
{{- $extra := .root.Values.autoscaling.extraMatchers }}
{{- printf "role=%q,namespace=%q" .role .root.Release.Namespace }}{{ if $extra }},{{ $extra }}{{ end }}
{{- end }}

{{/* The autoscaling signals of each role, as YAML. For each signal:
type    Pods (averaged over the role's pods) or External (one value for the role)
series  the series prometheus-adapter discovers
adapter prometheus-adapter metricsQuery (<<.Series>> etc. filled by the adapter)
keda    the query KEDA runs: a role total (AverageValue: divided by replicas)
        or a role-wide value (Value)
Usage: include "tandem.signals" $ | fromYaml */}}
{{- define "tandem.signals" -}}
{{- $w := .Values.autoscaling.window }}
{{- $r := include "tandem.promSelector" (dict "root" . "role" "router") }}
{{- $p := include "tandem.promSelector" (dict "root" . "role" "prefill") }}
{{- $d := include "tandem.promSelector" (dict "root" . "role" "decode") }}
{{- $k := include "tandem.promSelector" (dict "root" . "role" "kvstore") }}
router:
  requests_in_flight:
    type: Pods
    series: tandem:router_requests_in_flight
    adapter: 'sum(<<.Series>>{<<.LabelMatchers>>,role="router"}) by (<<.GroupBy>>)'
    keda: 'sum(tandem:router_requests_in_flight{ {{- $r -}} })'
prefill:
  waiting_prompt_tokens:
    type: Pods
    series: tandem:num_waiting_prompt_tokens
    adapter: 'sum(<<.Series>>{<<.LabelMatchers>>,role="prefill"}) by (<<.GroupBy>>)'
    keda: 'sum(tandem:num_waiting_prompt_tokens{ {{- $p -}} })'
  ttft_p90:
    type: External
    series: tandem:time_to_first_token_seconds_bucket
    adapter: 'histogram_quantile(0.9, sum by (le) (rate(<<.Series>>{<<.LabelMatchers>>,role="prefill"}[{{ $w }}])))'
    keda: 'histogram_quantile(0.9, sum by (le) (rate(tandem:time_to_first_token_seconds_bucket{ {{- $p -}} }[{{ $w }}])))'
decode:
  kv_cache_usage:
    type: Pods
    series: tandem:kv_cache_usage_perc
    adapter: 'avg(<<.Series>>{<<.LabelMatchers>>,role="decode"}) by (<<.GroupBy>>)'
    keda: 'sum(tandem:kv_cache_usage_perc{ {{- $d -}} })'
  running_requests:
    type: Pods
    series: tandem:num_requests_running
    adapter: 'sum(<<.Series>>{<<.LabelMatchers>>,role="decode"}) by (<<.GroupBy>>)'
    keda: 'sum(tandem:num_requests_running{ {{- $d -}} })'
  itl_p90:
    type: External
    series: tandem:inter_token_latency_seconds_bucket
    adapter: 'histogram_quantile(0.9, sum by (le) (rate(<<.Series>>{<<.LabelMatchers>>,role="decode"}[{{ $w }}])))'
    keda: 'histogram_quantile(0.9, sum by (le) (rate(tandem:inter_token_latency_seconds_bucket{ {{- $d -}} }[{{ $w }}])))'
kvstore:
  bytes_out_rate:
    type: Pods
    series: tandem:kvstore_bytes_out_total
    adapter: 'sum(rate(<<.Series>>{<<.LabelMatchers>>,role="kvstore"}[{{ $w }}])) by (<<.GroupBy>>)'
    keda: 'sum(rate(tandem:kvstore_bytes_out_total{ {{- $k -}} }[{{ $w }}]))'
{{- end }}

{{/* The roles that get an autoscaler: enabled, and scalable. */}}
{{- define "tandem.scaledRoles" -}}
{{- if not (has .Values.autoscaling.mode (list "none" "prometheus-adapter" "keda")) }}
{{- fail (printf "autoscaling.mode=%q is not one of: none, prometheus-adapter, keda" .Values.autoscaling.mode) }}
{{- end }}
{{- $roles := list "router" "decode" }}
{{- if .Values.prefill.enabled }}{{ $roles = append $roles "prefill" }}{{ end }}
{{- if .Values.kvstore.autoscaling.enabled }}
{{- if eq (include "tandem.storeBackend" .) "memory" }}
{{- fail "kvstore.autoscaling.enabled needs a Redis backend (redis.enabled or redis.url): in-memory kvstore replicas would not share blocks" }}
{{- end }}
{{- $roles = append $roles "kvstore" }}
{{- end }}
{{- $out := list }}
{{- range $roles }}
{{- if (get $.Values .).autoscaling.enabled }}{{ $out = append $out . }}{{ end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The chosen signal of a role, checked. Usage: (dict "root" $ "role" "decode") */}}
{{- define "tandem.roleSignal" -}}
{{- $signals := get (include "tandem.signals" .root | fromYaml) .role }}
{{- $name := (get .root.Values .role).autoscaling.signal }}
{{- if not (hasKey $signals $name) }}
{{- fail (printf "%s.autoscaling.signal=%q is not one of: %s" .role $name (keys $signals | sortAlpha | join ", ")) }}
{{- end }}
{{- toYaml (set (get $signals $name) "name" $name) }}
{{- end }}

{{/* Name of the metric prometheus-adapter serves for a role's signal. */}}
{{- define "tandem.adapterMetric" -}}
{{- printf "tandem_%s_%s" .role .signal }}
{{- end }}
