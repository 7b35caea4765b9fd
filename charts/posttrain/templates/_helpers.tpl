{{/*
Naming, labels and small derived values shared by every template.
*/}}

{{- define "posttrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-posttrain, or the release name alone when it already says posttrain,
truncated to 63 characters (the DNS-label limit of most names).
*/}}
{{- define "posttrain.fullname" -}}
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

{{- define "posttrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "posttrain.labels" -}}
helm.sh/chart: {{ include "posttrain.chart" . }}
app.kubernetes.io/name: {{ include "posttrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: posttrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of the operator pods (never change: Deployment selectors are immutable). */}}
{{- define "posttrain.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "posttrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "posttrain.minioSelectorLabels" -}}
app.kubernetes.io/name: {{ include "posttrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: minio
{{- end }}

{{- define "posttrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "posttrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag}; an empty tag means the chart's appVersion.
Usage: include "posttrain.image" (dict "image" .Values.images.trainer "root" .)
*/}}
{{- define "posttrain.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* Name of the Lease the operator replicas elect their leader on. */}}
{{- define "posttrain.leaseName" -}}
{{- default (include "posttrain.fullname" .) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{/* True (non-empty) when the operator watches every namespace. */}}
{{- define "posttrain.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{- define "posttrain.minioFullname" -}}
{{- printf "%s-minio" (include "posttrain.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* host:port (or URL) of S3: the configured endpoint, else the in-chart MinIO Service. */}}
{{- define "posttrain.s3Endpoint" -}}
{{- if .Values.storage.endpoint }}
{{- .Values.storage.endpoint }}
{{- else if .Values.minio.enabled }}
{{- printf "%s.%s.svc:9000" (include "posttrain.minioFullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the S3 credentials. */}}
{{- define "posttrain.s3SecretName" -}}
{{- if .Values.storage.existingSecret }}
{{- .Values.storage.existingSecret }}
{{- else if .Values.minio.enabled }}
{{- printf "%s-credentials" (include "posttrain.minioFullname" .) }}
{{- end }}
{{- end }}

{{/* Fail early, with the fix, on combinations the schema cannot express. */}}
{{- define "posttrain.validate" -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true: without leader election every replica would reconcile the same objects" }}
{{- end }}
{{- if not (include "posttrain.s3Endpoint" .) }}
{{- fail "no object storage: set storage.endpoint (and storage.existingSecret) to an existing S3/MinIO, or minio.enabled=true for an evaluation install" }}
{{- end }}
{{- if and .Values.sandbox.artifactsUri (not .Values.sandbox.artifactsEgress) (or .Values.storage.endpoint (not .Values.minio.enabled)) (not .Values.networkPolicy.s3CIDRs) }}
{{- fail "sandbox.artifactsUri with an external storage.endpoint needs networkPolicy.s3CIDRs (the store's addresses) or sandbox.artifactsEgress: sandbox pods with network: none may reach only the store and DNS, and without addresses that would be any host on networkPolicy.s3Ports" }}
{{- end }}
{{- if not (include "posttrain.s3SecretName" .) }}
{{- fail "storage.existingSecret is required with storage.endpoint: name a Secret in the release namespace holding the S3 access and secret keys" }}
{{- end }}
{{- end }}

{{/* Namespaces the chart prepares for workloads: runNamespaces plus the watched ones, as JSON. */}}
{{- define "posttrain.runNamespaces" -}}
{{- concat .Values.runNamespaces .Values.operator.watchNamespaces | uniq | toJson }}
{{- end }}

{{/*
Egress of sandbox pods with network=none, as JSON: sandbox.artifactsEgress when set; else, with
sandbox.artifactsUri, DNS (kube-dns in any namespace) and the object store: the in-chart MinIO
pods in the release namespace, or networkPolicy.s3Ports to s3CIDRs (posttrain.validate refuses
an external store without them: untrusted code must not reach any host on port 443). Without
artifactsUri, none: sandbox pods reach nothing.
*/}}
{{- define "posttrain.sandboxArtifactsEgress" -}}
{{- if .Values.sandbox.artifactsEgress }}
{{- .Values.sandbox.artifactsEgress | toJson }}
{{- else if .Values.sandbox.artifactsUri }}
{{- $dns := dict "to" (list (dict "namespaceSelector" (dict) "podSelector" (dict "matchLabels" (dict "k8s-app" "kube-dns")))) "ports" (list (dict "port" 53 "protocol" "UDP") (dict "port" 53 "protocol" "TCP")) }}
{{- $s3 := dict }}
{{- if and .Values.minio.enabled (not .Values.storage.endpoint) }}
{{- $minio := include "posttrain.minioSelectorLabels" . | fromYaml }}
{{- $s3 = dict "to" (list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" $minio))) "ports" (list (dict "port" 9000 "protocol" "TCP")) }}
{{- else }}
{{- $ports := list }}
{{- range .Values.networkPolicy.s3Ports }}
{{- $ports = append $ports (dict "port" . "protocol" "TCP") }}
{{- end }}
{{- $s3 = dict "ports" $ports }}
{{- with .Values.networkPolicy.s3CIDRs }}
{{- $to := list }}
{{- range . }}
{{- $to = append $to (dict "ipBlock" (dict "cidr" .)) }}
{{- end }}
{{- $_ := set $s3 "to" $to }}
{{- end }}
{{- end }}
{{- list $dns $s3 | toJson }}
{{- else }}
{{- list | toJson }}
{{- end }}
{{- end }}
