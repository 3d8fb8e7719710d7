{{/* Chart name, truncated to 63 characters (the DNS label limit). */}}
{{- define "memguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, unless the release name already holds the chart name. */}}
{{- define "memguard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A name derived from the full name with a suffix, still within 63 characters. */}}
{{- define "memguard.suffixed" -}}
{{- $full := include "memguard.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .suffix))) | trimSuffix "-") .suffix }}
{{- end }}

{{- define "memguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "memguard.labels" -}}
helm.sh/chart: {{ include "memguard.chart" . }}
{{ include "memguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: memguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels selecting the webhook pods. */}}
{{- define "memguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "memguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: webhook
{{- end }}

{{- define "memguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "memguard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The webhook image. */}}
{{- define "memguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The sidecar image: its own repository/tag, else the webhook's. */}}
{{- define "memguard.sidecarImage" -}}
{{- $repo := default .Values.image.repository .Values.sidecar.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.sidecar.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* Name of the Secret holding the serving certificate. */}}
{{- define "memguard.tlsSecretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else }}
{{- include "memguard.suffixed" (dict "root" . "suffix" "tls") }}
{{- end }}
{{- end }}

{{/* Name of the cert-manager Certificate (and of the self-signed Issuer). */}}
{{- define "memguard.certificateName" -}}
{{- include "memguard.suffixed" (dict "root" . "suffix" "serving-cert") }}
{{- end }}

{{/* DNS name of the webhook Service. */}}
{{- define "memguard.serviceHost" -}}
{{- printf "%s.%s.svc" (include "memguard.fullname" .) .Release.Namespace }}
{{- end }}

{{/* Namespaces the webhook never mutates. */}}
{{- define "memguard.excludedNamespaces" -}}
{{- $ns := list "kube-system" .Release.Namespace }}
{{- range .Values.webhook.excludedNamespaces }}{{ $ns = append $ns . }}{{ end }}
{{- toYaml (uniq $ns) }}
{{- end }}

{{/*
The policy document: the spec of the `default` MemguardPolicy and the webhook's --policy-file.
Its shape is memguard_api::PolicySpec (camelCase, unknown fields rejected).
*/}}
{{- define "memguard.policy" -}}
{{- $p := .Values.policy }}
{{- $client := dict "inject" $p.client.inject }}
{{- with $p.client.image }}{{ $_ := set $client "image" . }}{{ end }}
{{- /* helm --set gives "0.8" as a string: numbers are written as numbers. */}}
{{- $t := $p.thresholds }}
{{- $policy := dict
  "safetyRatio" (float64 $p.safetyRatio)
  "defaultGpuMemory" $p.defaultGpuMemory
  "thresholds" (dict "warn" (float64 $t.warn) "downgrade" (float64 $t.downgrade) "critical" (float64 $t.critical) "psiSomeAvg10" (float64 $t.psiSomeAvg10))
  "floors" $p.floors
  "maxOomRecoveries" $p.maxOomRecoveries
  "estimateLevel" (float64 $p.estimateLevel)
  "placement" $p.placement
  "servingShortenMaxLength" $p.servingShortenMaxLength
  "enforceGpuMemory" $p.enforceGpuMemory
  "client" $client
  "sidecar" (dict
    "image" (include "memguard.sidecarImage" .)
    "mode" .Values.sidecar.mode
    "interval" .Values.sidecar.interval
    "resources" .Values.sidecar.resources) }}
{{- with $p.gpuMemory }}{{ $_ := set $policy "gpuMemory" . }}{{ end }}
{{- with $p.envNames }}{{ $_ := set $policy "envNames" . }}{{ end }}
{{- with $p.models }}{{ $_ := set $policy "models" . }}{{ end }}
{{- toYaml $policy }}
{{- end }}
