{{/*
Rejects contradictory values with a message that says what to change. Included once, from
deployment.yaml; the schema (values.schema.json) has already checked types and names.
*/}}
{{- define "memguard.validate" -}}
{{- $tls := .Values.tls }}
{{- if and $tls.certManager.enabled $tls.existingSecret }}
{{- fail "memguard: tls.certManager.enabled and tls.existingSecret are two different TLS modes; set only one (cert-manager issues its own Secret)" }}
{{- end }}
{{- if and $tls.certManager.enabled $tls.caBundle }}
{{- fail "memguard: tls.caBundle is not used with tls.certManager.enabled (cert-manager injects the CA through cert-manager.io/inject-ca-from); remove tls.caBundle" }}
{{- end }}
{{- if and $tls.existingSecret (not $tls.caBundle) }}
{{- fail "memguard: tls.existingSecret needs tls.caBundle (base64-encoded PEM of the CA that signed it), or the API server cannot trust the webhook" }}
{{- end }}
{{- if and $tls.caBundle (not $tls.existingSecret) (not $tls.certManager.enabled) }}
{{- fail "memguard: tls.caBundle is set without tls.existingSecret; the self-signed mode generates its own CA. Set tls.existingSecret to the Secret this CA signed, or remove tls.caBundle" }}
{{- end }}
{{- if $tls.caBundle }}
{{- if not (contains "-----BEGIN CERTIFICATE-----" (b64dec $tls.caBundle)) }}
{{- fail "memguard: tls.caBundle must be a base64-encoded PEM certificate bundle (`base64 -w0 ca.crt`)" }}
{{- end }}
{{- end }}
{{- if and (not $tls.certManager.enabled) $tls.certManager.issuerRef.name }}
{{- fail "memguard: tls.certManager.issuerRef.name is set but tls.certManager.enabled is false; enable cert-manager mode or remove the issuerRef" }}
{{- end }}
{{- $w := .Values.webhook }}
{{- if and $w.podDisruptionBudget.enabled (ge (int $w.podDisruptionBudget.minAvailable) (int $w.replicas)) }}
{{- fail (printf "memguard: webhook.podDisruptionBudget.minAvailable (%d) must be below webhook.replicas (%d), or node drains block forever; raise replicas or disable the PodDisruptionBudget" (int $w.podDisruptionBudget.minAvailable) (int $w.replicas)) }}
{{- end }}
{{- if eq (int $w.port) (int $w.metricsPort) }}
{{- fail "memguard: webhook.port and webhook.metricsPort must differ" }}
{{- end }}
{{- $rule := .Values.monitoring.prometheusRule }}
{{- if and $rule.enabled (not .Values.monitoring.serviceMonitor.enabled) (not $rule.webhookJob) (not (has "MemguardWebhookDown" $rule.disabledAlerts)) }}
{{- fail "memguard: monitoring.prometheusRule.enabled needs the webhook scraped, or its alert MemguardWebhookDown fires forever: enable monitoring.serviceMonitor, or set monitoring.prometheusRule.webhookJob to the job label your own scrape config gives the webhook, or add MemguardWebhookDown to monitoring.prometheusRule.disabledAlerts" }}
{{- end }}
{{- /* policy.models names and aliases are unique as the webhook compares them (case-insensitively,
`_`, `.` and blanks as `-`): a duplicate would render, then stop the webhook at start. */}}
{{- $seen := dict }}
{{- range $i, $m := .Values.policy.models }}
{{- range $n := prepend (default (list) $m.aliases) $m.name }}
{{- $key := $n | trim | lower | replace "_" "-" | replace "." "-" | replace " " "-" }}
{{- with get $seen $key }}
{{- fail (printf "memguard: policy.models[%d]: `%s` is already a name of %s (names compare case-insensitively, `_` and `.` as `-`); rename one" $i $n .) }}
{{- end }}
{{- $_ := set $seen $key (printf "policy.models[%d] (`%s`)" $i $m.name) }}
{{- end }}
{{- end }}
{{- $t := .Values.policy.thresholds }}
{{- if not (and (lt 0.0 (float64 $t.warn)) (lt (float64 $t.warn) (float64 $t.downgrade)) (lt (float64 $t.downgrade) (float64 $t.critical)) (le (float64 $t.critical) 1.0)) }}
{{- fail (printf "memguard: policy.thresholds must satisfy 0 < warn < downgrade < critical <= 1 (got %v, %v, %v)" $t.warn $t.downgrade $t.critical) }}
{{- end }}
{{- end }}
