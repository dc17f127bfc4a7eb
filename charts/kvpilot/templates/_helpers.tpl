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

{{/* Labels of every object: commonLabels, then the chart's own (which win on conflicts). */}}
{{- define "kvpilot.labels" -}}
{{- $own := dict -}}
{{- $_ := set $own "helm.sh/chart" (include "kvpilot.chart" .) -}}
{{- $_ := merge $own (include "kvpilot.selectorLabels" . | fromYaml) -}}
{{- $_ := set $own "app.kubernetes.io/version" .Chart.AppVersion -}}
{{- $_ := set $own "app.kubernetes.io/managed-by" .Release.Service -}}
{{- $_ := set $own "app.kubernetes.io/part-of" "kvpilot" -}}
{{- toYaml (merge $own (.Values.commonLabels | default dict)) }}
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
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- /* spec.router and spec.autoscaling children (deleted again when their field is removed). */}}
- apiGroups: [apps]
  resources: [deployments]
  verbs: [delete]
- apiGroups: [""]
  resources: [services]
  verbs: [delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
{{- /* The router's right to wake its InferenceService from zero (spec.router.frontDoor with
limits.minReplicas 0): a ServiceAccount and a Role granting get and patch on that one
InferenceService, which the operator holds itself (RBAC allows granting no more than one holds). */}}
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch, delete]
{{- end }}
{{- end }}

{{/*
Labels every engine pod carries and the port its API and /metrics listen on, as the operator's
builders set them (operator/api/names.py: LABEL_NAME=ENGINE_NAME, LABEL_MANAGED_BY=MANAGED_BY,
HTTP_PORT; a test checks the NetworkPolicies against the rendered engine pods).
*/}}
{{- define "kvpilot.engineSelectorLabels" -}}
app.kubernetes.io/name: kvpilot-engine
app.kubernetes.io/managed-by: kvpilot-operator
{{- end }}

{{- define "kvpilot.enginePort" -}}
8000
{{- end }}

{{/* The namespaces engine NetworkPolicies go to: networkPolicy.engine.namespaces, else watchNamespaces. */}}
{{- define "kvpilot.engineNamespaces" -}}
{{- toJson (.Values.networkPolicy.engine.namespaces | default .Values.operator.watchNamespaces | default list) }}
{{- end }}

{{/* "true" when the operator replicas elect a leader (replicaCount > 1 or leaderElection.enabled). */}}
{{- define "kvpilot.leaderElection" -}}
{{- $le := .Values.operator.leaderElection }}
{{- if or $le.enabled (gt (int .Values.operator.replicaCount) 1) }}
{{- if not (and (lt (float64 $le.retryPeriod) (float64 $le.renewDeadline)) (lt (float64 $le.renewDeadline) (float64 $le.leaseDuration))) }}
{{- fail "operator.leaderElection needs retryPeriod < renewDeadline < leaseDuration: a leader must stop before a standby may take over" }}
{{- end }}true
{{- end }}
{{- end }}
