{{- define "peregrine.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "peregrine.labels" -}}
app.kubernetes.io/name: peregrine-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "peregrine.selectorLabels" -}}
app.kubernetes.io/name: peregrine-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "peregrine.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "peregrine.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
