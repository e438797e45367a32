{{/*
Mutual TLS on the gRPC hops (values tls.*): the Secret (ca.crt, tls.crt, tls.key) is
mounted read-only at /etc/pdserve/tls in the router and worker pods. Workers serve with
tls.crt and require client certificates signed by ca.crt; the router and decode workers
present tls.crt and, dialing pod IPs, check for tls.serverName in the peer's certificate.
*/}}
{{- define "pdserve.tls.dir" -}}/etc/pdserve/tls{{- end }}

{{- define "pdserve.tls.volume" -}}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled is true" .Values.tls.secretName | quote }}
    # owner root, group fsGroup (podSecurityContext): readable by the pdserve user only
    defaultMode: 0440
{{- end }}

{{- define "pdserve.tls.volumeMount" -}}
- name: tls
  mountPath: {{ include "pdserve.tls.dir" . }}
  readOnly: true
{{- end }}

{{/* worker args; called with (dict "root" $ "role" "prefill"|"decode") */}}
{{- define "pdserve.tls.workerArgs" -}}
{{- $dir := include "pdserve.tls.dir" .root }}
- --tls-cert-file
- {{ printf "%s/tls.crt" $dir | quote }}
- --tls-key-file
- {{ printf "%s/tls.key" $dir | quote }}
- --tls-ca-file
- {{ printf "%s/ca.crt" $dir | quote }}
{{- if eq .role "decode" }}
- --tls-server-name
- {{ .root.Values.tls.serverName | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.tls.routerArgs" -}}
{{- $dir := include "pdserve.tls.dir" . }}
- --worker-tls-ca-file
- {{ printf "%s/ca.crt" $dir | quote }}
- --worker-tls-cert-file
- {{ printf "%s/tls.crt" $dir | quote }}
- --worker-tls-key-file
- {{ printf "%s/tls.key" $dir | quote }}
- --worker-tls-server-name
- {{ .Values.tls.serverName | quote }}
{{- end }}

{{/*
Kubelet's gRPC probes cannot speak TLS: with TLS on, the worker probes run the image's
healthcheck.py inside the container instead, over mutual TLS with the same files.
*/}}
{{- define "pdserve.tls.healthcheckEnv" -}}
{{- $dir := include "pdserve.tls.dir" . }}
- name: PDSERVE_HEALTHCHECK_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
- name: PDSERVE_HEALTHCHECK_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: PDSERVE_HEALTHCHECK_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
- name: PDSERVE_HEALTHCHECK_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}

{{/* a worker probe's handler; called with (dict "root" $ "port" N) */}}
{{- define "pdserve.tls.probeHandler" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - python
    - /opt/pdserve/healthcheck.py
    - grpc
    - {{ printf "127.0.0.1:%d" (int .port) | quote }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}
