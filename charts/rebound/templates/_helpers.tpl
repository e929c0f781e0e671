{{/* The operator's name: app.kubernetes.io/name. */}}
{{- define "rebound.name" -}}
{{- default "rebound-operator" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the Deployment, ServiceAccount, ClusterRole, ...: "<release>-operator". */}}
{{- define "rebound.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The sidecars' ClusterRole and Lease admission policy: "<release>-sidecar". */}}
{{- define "rebound.sidecarName" -}}
{{- printf "%s-sidecar" .Release.Name | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{- define "rebound.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rebound.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rebound.labels" -}}
{{ include "rebound.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: rebound
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "rebound.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rebound.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rebound.leaseName" -}}
{{- default (include "rebound.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* Leader election runs when it is on; with several replicas the schema requires it. */}}
{{- define "rebound.leaderElection" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) -}}true{{- end -}}
{{- end -}}

{{- define "rebound.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Checks the schema cannot express. */}}
{{- define "rebound.validate" -}}
{{- if ge (int .Values.leaderElection.leaseGrace) (int .Values.leaderElection.leaseDuration) -}}
{{- fail (printf "leaderElection.leaseGrace (%v) must be below leaderElection.leaseDuration (%v)" .Values.leaderElection.leaseGrace .Values.leaderElection.leaseDuration) -}}
{{- end -}}
{{- end -}}
