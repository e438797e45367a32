{{/* Names, labels and small shared pieces. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of a component's objects: <fullname>-<component> (router, prefill, decode). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The worker image (never `latest` by default: the tag falls back to appVersion). */}}
{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.routerImage" -}}
{{- $repo := default .Values.image.repository .Values.router.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.router.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The DNS name the router resolves to find a pool's workers (its headless Service). */}}
{{- define "pdserve.workerAddress" -}}
{{- $w := index .root.Values .role }}
{{- printf "%s.%s.svc.%s:%d" (include "pdserve.componentName" (dict "root" .root "component" .role)) .root.Release.Namespace .root.Values.clusterDomain (int $w.port) }}
{{- end }}

{{/* A PodDisruptionBudget spec body from {enabled, maxUnavailable, minAvailable}. */}}
{{- define "pdserve.pdbSpec" -}}
{{- if and (ne (toString .minAvailable) "") (ne (toString .minAvailable) "<nil>") }}
minAvailable: {{ .minAvailable }}
{{- else }}
maxUnavailable: {{ .maxUnavailable }}
{{- end }}
{{- end }}

{{/* HorizontalPodAutoscaler metrics from {metrics, targetCPUUtilizationPercentage}. */}}
{{- define "pdserve.hpaMetrics" -}}
{{- if .metrics }}
{{- toYaml .metrics }}
{{- else }}
- type: Resource
  resource:
    name: cpu
    target:
      type: Utilization
      averageUtilization: {{ .targetCPUUtilizationPercentage }}
{{- end }}
{{- end }}
