{{/* The prefix of every object's name: the release's name, with nvpool in it. */}}
{{- define "nvpool.fullname" -}}
{{- if contains "nvpool" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-nvpool" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nvpool.labels" -}}
app.kubernetes.io/name: nvpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: nvpool.selector (list . "engine") */}}
{{- define "nvpool.selector" -}}
app.kubernetes.io/name: nvpool
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "nvpool.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "nvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "nvpool.tag" .) -}}
{{- end -}}

{{/* The controllers' gRPC addresses, as every client is given them. */}}
{{- define "nvpool.controllers" -}}
{{- $name := include "nvpool.fullname" . -}}
{{- $list := list -}}
{{- range $i := until (int .Values.controller.replicas) -}}
{{- $list = append $list (printf "%s-controller-%d.%s-controller-pods.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.controller.port)) -}}
{{- end -}}
{{- join "," $list -}}
{{- end -}}

{{/* Where the storage nodes keep the binary an engine hot-upgrades to. */}}
{{- define "nvpool.binDir" -}}/var/lib/nvpool/bin{{- end -}}

{{/* TLS: the flag, the volume mount and the volume, where TLS is on. */}}
{{- define "nvpool.tlsArgs" -}}
{{- if .Values.tls.enabled }}["--tls-dir", "/etc/nvpool/tls"]{{ else }}[]{{ end -}}
{{- end -}}
{{- define "nvpool.tlsMount" -}}
{{- if .Values.tls.enabled -}}
- {name: tls, mountPath: /etc/nvpool/tls, readOnly: true}
{{- end -}}
{{- end -}}
{{- define "nvpool.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret: {secretName: {{ .Values.tls.secretName }}, defaultMode: 0400}
{{- end -}}
{{- end -}}

{{- define "nvpool.pullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}
