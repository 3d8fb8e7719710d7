{{/*
memguard's alerting rules, rendered into the PrometheusRule (prometheusrule.yaml). Each define
returns a YAML list of rules; "memguard.ruleGroups" drops the disabled ones, adds `alertLabels`
and `runbook_url`, and leaves out empty groups. Runbook: docs/alerts.md, one section per alert.
Metric names: webhook/src/metrics.rs, learn/src/metrics.rs, sidecar/src/metrics.rs (a chart test
checks them). Text between {{` and `}} is a Prometheus template, expanded when the alert fires.

The webhook's error counters are labelled families: a `result="error"` series appears with the
value 1 at the first error, which `increase()` cannot see. "memguard.newOrIncreased" also catches
a series that did not exist `w` ago.
*/}}

{{- define "memguard.newOrIncreased" -}}
increase({{ .m }}[{{ .w }}]) > 0
  or ({{ .m }} unless {{ .m }} offset {{ .w }})
{{- end }}

{{- define "memguard.alerts.webhook" -}}
{{- $r := .Values.monitoring.prometheusRule }}
{{- $ns := .Release.Namespace }}
{{- $job := default (include "memguard.fullname" .) $r.webhookJob }}
{{- $deploy := printf "kubectl -n %s logs deploy/%s" $ns (include "memguard.fullname" .) }}
- alert: MemguardWebhookDown
  expr: absent(up{job={{ $job | quote }}, namespace={{ $ns | quote }}} == 1)
  for: 5m
  labels:
    severity: critical
  annotations:
    summary: No memguard webhook replica is up; new pods are admitted without memguard.
    description: >-
      Prometheus has scraped no healthy target of job {{ $job | quote }} in namespace
      {{ $ns }} for 5 minutes. The webhook fails open (failurePolicy Ignore), so training pods
      created meanwhile get no estimate, no downgrade plan and no sidecar. Check
      `kubectl -n {{ $ns }} get pods,endpoints -l app.kubernetes.io/instance={{ .Release.Name }}`
      and `{{ $deploy }}`.
- alert: MemguardWebhookAdmissionErrors
  expr: |-
    sum by (namespace, job) (rate(memguard_webhook_admission_requests_total{outcome="error"}[5m]))
      / sum by (namespace, job) (rate(memguard_webhook_admission_requests_total[5m]))
      > {{ $r.admissionErrorRatio }}
  for: 10m
  labels:
    severity: warning
  annotations:
    summary: {{`memguard fails {{ $value | humanizePercentage }} of admission requests.`}}
    description: >-
      {{`{{ $value | humanizePercentage }}`}} of the AdmissionReviews answered by job
      {{`{{ $labels.job }}`}} ended in an error for 10 minutes. Those pods were admitted
      unchanged, without memguard's plan or sidecar. The reasons are in the webhook's logs
      (`{{ $deploy }}`): "admission reviewed" lines with outcome error carry the warning
      returned to the client, "bad request" lines a body that was no AdmissionReview.
- alert: MemguardWebhookCertificateExpiring
  expr: |-
    (memguard_webhook_certificate_expiry_timestamp_seconds > 0) - time()
      < {{ $r.certificateExpiryDays }} * 86400
  for: 1h
  labels:
    severity: warning
  annotations:
    summary: {{`The memguard webhook's serving certificate expires in {{ $value | humanizeDuration }}.`}}
    description: >-
      {{`Pod {{ $labels.namespace }}/{{ $labels.pod }} serves a certificate that expires in
      {{ $value | humanizeDuration }}.`}} Once it has expired the API server cannot call the
      webhook and pods are admitted without memguard. Renew it (cert-manager: check the
      Certificate's status; tls.existingSecret: replace the Secret) and check that the webhook
      reloaded it (MemguardWebhookCertificateReloadFailed).
- alert: MemguardWebhookCertificateReloadFailed
  expr: |-
    {{- include "memguard.newOrIncreased" (dict "m" "memguard_webhook_certificate_reloads_total{result=\"error\"}" "w" "1h") | nindent 4 }}
  labels:
    severity: warning
  annotations:
    summary: The memguard webhook rejected a new serving certificate.
    description: >-
      {{`Pod {{ $labels.namespace }}/{{ $labels.pod }}`}} could not load the certificate files
      that changed in the last hour and keeps serving the previous certificate. Check the
      Secret's tls.crt and tls.key (a matching PEM pair, valid for the webhook's Service) and
      the webhook's log line "new certificate rejected" (`{{ $deploy }}`).
- alert: MemguardPolicyRejected
  expr: |-
    {{- include "memguard.newOrIncreased" (dict "m" "memguard_webhook_policy_reloads_total{result=\"error\"}" "w" "1h") | nindent 4 }}
  labels:
    severity: warning
  annotations:
    summary: An edit of the MemguardPolicy was rejected and is NOT in force.
    description: >-
      {{`Pod {{ $labels.namespace }}/{{ $labels.pod }}`}} rejected the MemguardPolicy in the
      last hour as invalid and keeps admitting pods with the previous policy. The webhook's log
      line "MemguardPolicy invalid" (`{{ $deploy }}`) lists every problem; fix them with
      `kubectl edit memguardpolicy default`. This alert resolves an hour after the last
      rejection, whether or not the policy was fixed.
- alert: MemguardProfileControllerNoLeader
  expr: max by (namespace, job) (memguard_webhook_profile_leader) == 0
  for: 10m
  labels:
    severity: warning
  annotations:
    summary: No memguard webhook replica has led the profile controller for 10 minutes.
    description: >-
      {{`No replica of job {{ $labels.job }} in {{ $labels.namespace }}`}} holds the Lease
      memguard-profile-controller, so MemoryProfiles learn nothing from finished or OOM-killed
      runs (admission still works). Check the Lease
      (`kubectl -n {{ $ns }} get lease memguard-profile-controller -o yaml`), the webhook's
      RBAC on leases and `{{ $deploy }}`.
- alert: MemguardProfileControllerErrors
  expr: |-
    sum by (namespace, job, error) (increase(memguard_webhook_profile_errors_total[10m])) > 0
  for: 15m
  labels:
    severity: warning
  annotations:
    summary: {{`The memguard profile controller keeps failing ({{ $labels.error }}).`}}
    description: >-
      {{`The profile controller of job {{ $labels.job }} has failed with error
      "{{ $labels.error }}" for 15 minutes`}}, so MemoryProfiles are not updated. `lease`,
      `get_profile`, `create_profile`, `patch_status`: check the webhook's RBAC and the API
      server; `conflicts`: another writer edits MemoryProfiles; `key_collision`: two models
      share a profile key. Details in `{{ $deploy }}`.
{{- end }}

{{- define "memguard.alerts.sidecar" -}}
{{- $r := .Values.monitoring.prometheusRule }}
{{- $pod := `{{ $labels.namespace }}/{{ $labels.pod }}` }}
{{- $logs := `kubectl -n {{ $labels.namespace }} logs {{ $labels.pod }} -c memguard-sidecar` }}
- alert: MemguardTrainerCriticalPressure
  expr: memguard_sidecar_level == 3
  for: 2m
  labels:
    severity: critical
  annotations:
    summary: {{ printf "Trainer %s is about to be OOM-killed." $pod }}
    description: >-
      The memguard sidecar of {{ $pod }} has signalled level critical (working set at or above
      the critical threshold of its limit) for 2 minutes: downgrades are exhausted or the
      trainer does not apply them. Check that the trainer reads the signal (memguard_client),
      the pod's `memguard.io/estimate` annotation against its limit, and `{{ $logs }}`; give the
      pod more memory or a smaller batch before it is killed.
- alert: MemguardTrainerOOMKilled
  expr: increase(memguard_sidecar_oom_kills_total[10m]) > 0
  labels:
    severity: warning
  annotations:
    summary: {{ printf "Trainer %s was OOM-killed despite memguard." $pod }}
    description: >-
      The kernel OOM-killed a process of {{ $pod }} in the last 10 minutes. The profile
      controller records the kill and the next run of the same model gets a recovery plan.
      Find out why memguard did not prevent it: `{{ $logs }}` shows the levels the sidecar
      signalled (none: the growth was too fast for its interval; signalled: the trainer did
      not apply them), and the pod's `memguard.io/estimate` annotation the plan it was
      admitted with.
{{- $within := ternary "an hour" $r.downgradesWindow (eq $r.downgradesWindow "1h") }}
- alert: MemguardTrainerRepeatedDowngrades
  expr: increase(memguard_sidecar_downgrades_total[{{ $r.downgradesWindow }}]) >= {{ $r.downgradesPerHour }}
  {{- with $r.downgradesFor }}
  for: {{ . }}
  {{- end }}
  labels:
    severity: info
  annotations:
    summary: {{ printf "Trainer %s was downgraded %s times in %s." $pod `{{ $value | humanize }}` $within }}
    description: >-
      The memguard sidecar of {{ $pod }} signalled {{`{{ $value | humanize }}`}} downgrades in
      the last {{ trimPrefix "an " $within }}: the admission plan left too little headroom for this model. Check the
      pod's `memguard.io/estimate` against its peak (`memguard_sidecar_cgroup_peak_bytes`),
      set a smaller batch in its annotations, or let its MemoryProfile calibrate.
- alert: MemguardTrainerMemoryLeak
  expr: memguard_sidecar_leak_seconds_to_limit < {{ $r.leakSecondsToLimit }}
  for: 2m
  labels:
    severity: warning
  annotations:
    summary: {{ printf "Trainer %s reaches its memory limit in %s." $pod `{{ $value | humanizeDuration }}` }}
    description: >-
      The working set of {{ $pod }} has grown steadily for 2 minutes and, at that rate, reaches
      the limit in {{`{{ $value | humanizeDuration }}`}}. Downgrades do not fix a leak: look for
      tensors kept across steps (losses or outputs stored without `.detach()`/`.item()`,
      growing caches) and save a checkpoint now.
- alert: MemguardSidecarSampleErrors
  expr: rate(memguard_sidecar_sample_errors_total[5m]) > 0
  for: 15m
  labels:
    severity: warning
  annotations:
    summary: {{ printf "The memguard sidecar of %s cannot sample memory (%s)." $pod `{{ $labels.kind }}` }}
    description: >-
      The sidecar of {{ $pod }} has failed to {{`{{ if eq $labels.kind "gpu" }}read GPU memory
      through NVML{{ else }}{{ $labels.kind }} the cgroup's memory files{{ end }}`}} for 15
      minutes; its pressure figures and signals may be stale, so it may not protect the
      trainer. See `{{ $logs }}` (warning "sampler failed").
- alert: MemguardSidecarSignalWriteErrors
  expr: rate(memguard_sidecar_signal_write_errors_total[5m]) > 0
  for: 10m
  labels:
    severity: warning
  annotations:
    summary: {{ printf "The memguard sidecar of %s cannot write the signal file." $pod }}
    description: >-
      The sidecar of {{ $pod }} has failed to write /var/run/memguard/signal.json for 10
      minutes. Trainers that poll the file miss downgrades (the HTTP API still serves the
      signal). Check the memguard-signal volume's mount and free space, and `{{ $logs }}`.
{{- end }}

{{/* The rule groups of the PrometheusRule's spec. */}}
{{- define "memguard.ruleGroups" -}}
{{- $r := .Values.monitoring.prometheusRule }}
{{- $groups := list }}
{{- range $name := list "webhook" "sidecar" }}
{{- $rules := list }}
{{- range include (printf "memguard.alerts.%s" $name) $ | fromYamlArray }}
{{- if not (has .alert $r.disabledAlerts) }}
{{- $_ := set . "labels" (merge .labels $r.alertLabels) }}
{{- if $r.runbookUrl }}
{{- $_ := set .annotations "runbook_url" (printf "%s#%s" $r.runbookUrl (lower .alert)) }}
{{- end }}
{{- $rules = append $rules . }}
{{- end }}
{{- end }}
{{- if $rules }}
{{- $groups = append $groups (dict "name" (printf "memguard-%s" $name) "rules" $rules) }}
{{- end }}
{{- end }}
{{- with $r.extraRules }}
{{- $groups = append $groups (dict "name" "memguard-extra" "rules" .) }}
{{- end }}
{{- toYaml $groups }}
{{- end }}
