{{/* Chart name, truncated to fit label values. */}}
{{- define "sftjob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, plus the chart name unless the release name has it. */}}
{{- define "sftjob-operator.fullname" -}}
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

{{- define "sftjob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sftjob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sftjob-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "sftjob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: sftjob
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "sftjob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sftjob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sftjob-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The operator's rules on namespaced resources: in a ClusterRole for a cluster-wide install,
in a Role per watched namespace otherwise. One rule per resource, so that a test can take
each away and name the operator code path that breaks (tests/chart/rbac_needs.py).
*/}}
{{- define "sftjob-operator.namespacedRules" -}}
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs/status"]
  verbs: ["patch"]
{{- if .Values.rbac.ownerReferencesPermissionEnforcement }}
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs/finalizers"]
  verbs: ["update"]
{{- end }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.jobNetworkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
{{- end }}
{{- end }}

{{/* Cluster-scoped resources: needed in both install modes. */}}
{{- define "sftjob-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.rbac.readNodes }}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list"]
{{- end }}
{{- end }}

{{/*
Leader election (leader.py): the Lease named like the release, in the release namespace.
`create` cannot be limited to a name (the name is not known to the authorizer before the
object exists), so it is a rule of its own; reading and renewing are limited to the one Lease.
*/}}
{{- define "sftjob-operator.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "sftjob-operator.fullname" . | quote }}]
  verbs: ["get", "update"]
{{- end }}

{{/* Operator command-line scope flags. */}}
{{- define "sftjob-operator.scopeArgs" -}}
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- end }}

{{/*
Who may reach the trainers' metrics port under each job's NetworkPolicy: this operator's
pods (they read rank 0's progress) and the peers in jobNetworkPolicy.metricsFrom. JSON for
the operator's --trainer-metrics-from.
*/}}
{{- define "sftjob-operator.trainerMetricsFrom" -}}
{{- $self := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "sftjob-operator.selectorLabels" . | fromYaml)) -}}
{{- prepend .Values.jobNetworkPolicy.metricsFrom $self | toJson -}}
{{- end }}
