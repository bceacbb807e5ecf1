{{/* The Deployment and Service of one role. Usage:
include "tandem.workload" (dict "root" $ "role" "decode" "model" true "engine" true
  "ports" (list (dict "name" "grpc" "port" 50071)) "env" "<yaml list>"
  "probes" "<yaml>" "metricsPort" 9071 "metricsPath" "/metrics"
  "headless" true)
Every role's pods carry that role's selector labels and nothing else does,
so each Service selects exactly its Deployment's pods. */}}
{{- define "tandem.workload" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $cfg := get $v .role }}
{{- $name := include "tandem.roleName" (dict "root" $root "role" .role) }}
{{- $sel := dict "root" $root "role" .role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "tandem.roleLabels" $sel | nindent 4 }}
spec:
  {{- if not (and (ne $v.autoscaling.mode "none") $cfg.autoscaling.enabled) }}
  # Without an autoscaler the chart owns the replica count; with one, the
  # autoscaler does and the chart leaves the field alone on upgrades.
  replicas: {{ $cfg.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.roleLabels" $sel | nindent 8 }}
      {{- if $v.metrics.podAnnotations }}
      annotations:
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ .metricsPort | toString | quote }}
        prometheus.io/path: {{ .metricsPath | quote }}
      {{- end }}
    spec:
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
      {{- with (include "tandem.scheduling" (dict "root" $root "cfg" $cfg) | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .role }}
          image: {{ include "tandem.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args:
            - serve
            - {{ .role }}
            {{- range $cfg.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          env:
            {{- .env | trim | nindent 12 }}
            {{- include "tandem.commonEnv" (dict "root" $root "role" .role "model" .model "engine" .engine) | trim | nindent 12 }}
          {{- .probes | trim | nindent 10 }}
          {{- include "tandem.lifecycle" (dict "cfg" $cfg) | nindent 10 }}
          resources:
            {{- include "tandem.resources" (dict "root" $root "cfg" $cfg) | nindent 12 }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "tandem.volumeMounts" (dict "root" $root "model" .model "role" .role) | nindent 12 }}
      volumes:
        {{- include "tandem.volumes" (dict "root" $root "model" .model "role" .role) | nindent 8 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "tandem.roleLabels" $sel | nindent 4 }}
  {{- with (and $cfg.service $cfg.service.annotations) }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .headless }}
  # Headless: the name resolves to the IPs of the ready pods, one instance each.
  clusterIP: None
  {{- else }}
  type: {{ (and $cfg.service $cfg.service.type) | default "ClusterIP" }}
  {{- end }}
  selector:
    {{- include "tandem.selectorLabels" $sel | nindent 4 }}
  ports:
    {{- range .ports }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
      {{- if hasPrefix "grpc" .name }}
      appProtocol: grpc
      {{- end }}
    {{- end }}
{{- end }}
