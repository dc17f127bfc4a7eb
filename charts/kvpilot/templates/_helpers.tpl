{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kvpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "kvpilot.fullname" -}}
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

{{/* chart-version, as the helm.sh/chart label wants it. */}}
{{- define "kvpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ include "kvpilot.chart" . }}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpilot
{{- end }}

{{/* Labels the operator Deployment selects its pod by. */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The permissions the operator uses, no more: kopf watches and annotates InferenceServices and posts
Events; the reconciler writes status and server-side-applies the engine Deployment, Service and
PodDisruptionBudget (apply creates missing objects, hence create); it watches engine Deployments
for rollout progress; remediation lists engine pods (to scrape their /metrics) and posts Events. Setting blockOwnerDeletion on the children's owner references requires update
on inferenceservices/finalizers where the OwnerReferencesPermissionEnforcement admission plugin runs.
Nothing is deleted by the operator: children go away with their InferenceService (garbage collection).
*/}}
{{- define "kvpilot.rules" -}}
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [serving.kvpilot.io]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch, delete]
{{- end }}
{{- end }}
