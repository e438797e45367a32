{{/*
One worker pool: Deployment, headless Service, PodDisruptionBudget, HorizontalPodAutoscaler
and PodMonitor. prefill.yaml and decode.yaml call it with the role as argument:

  {{ include "pdserve.worker" (dict "root" . "role" "prefill") }}

`.Values.<role>` holds the pool's values; decode-only flags are added for role decode.
*/}}
{{- define "pdserve.worker" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $w := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $name := include "pdserve.componentName" $ctx }}
{{- $e := $w.engine }}
{{- $v := $root.Values }}
{{- /* resources: the configured ones plus GPU, RDMA and huge pages */}}
{{- /* the schema checks it too; this also holds with --skip-schema-validation */}}
{{- $tp := int $w.tensorParallelSize }}
{{- if or (lt $tp 1) (ne (toString $tp) (toString $w.tensorParallelSize)) }}
{{- fail (printf "%s.tensorParallelSize must be a positive integer, got %v" $role $w.tensorParallelSize) }}
{{- end }}
{{- $res := deepCopy ($w.resources | default dict) }}
{{- $limits := $res.limits | default dict }}
{{- $requests := $res.requests | default dict }}
{{- if gt (int $w.gpu.count) 0 }}
{{- /* one GPU per tensor-parallel rank at least */}}
{{- $gpus := max (int $w.gpu.count) $tp }}
{{- $_ := set $limits $w.gpu.resource $gpus }}
{{- $_ := set $requests $w.gpu.resource $gpus }}
{{- end }}
{{- if gt (int $w.rdma.count) 0 }}
{{- $_ := set $limits $w.rdma.resource (int $w.rdma.count) }}
{{- $_ := set $requests $w.rdma.resource (int $w.rdma.count) }}
{{- end }}
{{- $hugepages := "" }}
{{- if $w.hugepages.amount }}
{{- $hugepages = printf "hugepages-%s" $w.hugepages.size }}
{{- $_ := set $limits $hugepages $w.hugepages.amount }}
{{- $_ := set $requests $hugepages $w.hugepages.amount }}
{{- end }}
{{- $_ := set $res "limits" $limits }}
{{- $_ := set $res "requests" $requests }}
{{- /* container security context: RDMA memory registration needs IPC_LOCK */}}
{{- $sc := deepCopy ($v.securityContext | default dict) }}
{{- if gt (int $w.rdma.count) 0 }}
{{- $caps := deepCopy ($sc.capabilities | default dict) }}
{{- $_ := set $caps "add" (concat ($caps.add | default list) (list "IPC_LOCK") | uniq) }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not $w.autoscaling.enabled }}
  replicas: {{ $w.replicas }}
  {{- end }}
  strategy:
    {{- toYaml $w.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.selectorLabels" $ctx | nindent 8 }}
        {{- with $w.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $w.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $w.terminationGracePeriodSeconds }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $w.hostIPC }}
      hostIPC: true
      {{- end }}
      {{- with $w.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $w.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $w.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args:
            - pdserve
            - {{ $role }}
            - --model
            - {{ $v.model.name | quote }}
            {{- if and (ne $v.model.source "hub") (or $v.model.hub.revision $v.model.hub.tokenSecret) }}
            {{- fail "model.hub.revision / model.hub.tokenSecret apply to model.source hub" }}
            {{- end }}
            {{- if and (eq $v.model.source "hub") $v.model.hub.revision }}
            - --revision
            - {{ $v.model.hub.revision | quote }}
            {{- end }}
            - --device
            - {{ $e.device | quote }}
            - --dtype
            - {{ $e.dtype | quote }}
            - --kv-cache-dtype
            - {{ $e.kvCacheDtype | quote }}
            - --load-format
            - {{ $e.loadFormat | quote }}
            - --block-size
            - {{ $e.blockSize | int | quote }}
            {{- if $e.numKvBlocks }}
            - --num-kv-blocks
            - {{ $e.numKvBlocks | int | quote }}
            {{- else }}
            - --kv-cache-memory-gb
            - {{ $e.kvCacheMemoryGb | toString | quote }}
            {{- end }}
            - --max-num-seqs
            - {{ $e.maxNumSeqs | int | quote }}
            - --max-num-batched-tokens
            - {{ $e.maxNumBatchedTokens | int | quote }}
            {{- if $e.maxModelLen }}
            - --max-model-len
            - {{ $e.maxModelLen | int | quote }}
            {{- end }}
            {{- if not $e.enablePrefixCaching }}
            - --no-prefix-caching
            {{- end }}
            - --kernel-backend
            - {{ $e.kernelBackend | quote }}
            {{- if $e.kernelChoices }}
            - --kernel-choices
            - {{ $e.kernelChoices | quote }}
            {{- end }}
            {{- if $e.enforceEager }}
            - --enforce-eager
            {{- end }}
            - --tensor-parallel-size
            - {{ $tp | quote }}
            - --host
            - "0.0.0.0"
            - --port
            - {{ $w.port | int | quote }}
            - --metrics-port
            - {{ $w.metricsPort | int | quote }}
            - --transfer-backend
            - {{ $v.kvTransfer.backend | quote }}
            - --transfer-protocol
            - {{ $v.kvTransfer.protocol | quote }}
            - --transfer-hostname
            - "$(POD_IP)"
            - --transfer-metadata
            - {{ $v.kvTransfer.metadata | quote }}
            {{- if $w.transferDevice }}
            - --transfer-device
            - {{ $w.transferDevice | quote }}
            {{- end }}
            - --kv-transfer-timeout
            - {{ $v.kvTransfer.timeout | toString | quote }}
            - --drain-timeout
            - {{ $w.drainTimeout | toString | quote }}
            {{- if eq $role "decode" }}
            - --prefill-timeout
            - {{ $w.prefillTimeout | toString | quote }}
            - --prefill-failure-policy
            - {{ $w.prefillFailurePolicy | quote }}
            - --reserve-timeout
            - {{ $w.reserveTimeout | toString | quote }}
            {{- end }}
            {{- if $v.tls.enabled }}
            {{- include "pdserve.tls.workerArgs" (dict "root" $root "role" $role) | nindent 12 }}
            {{- end }}
            {{- range $w.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            # the address the other pool's transfer engine reaches this pod at
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: PDSERVE_CACHE_DIR
              value: {{ $v.model.cache.path | quote }}
            {{- if eq $v.model.source "hub" }}
            {{- if eq $v.model.cache.type "image" }}
            {{- fail "model.source hub downloads into the model cache: set model.cache.type to emptyDir or pvc (the image's cache is read-only)" }}
            {{- end }}
            # the Hugging Face cache on the model cache volume: a pvc downloads once
            - name: HF_HOME
              value: {{ printf "%s/huggingface" $v.model.cache.path | quote }}
            {{- with $v.model.hub.tokenSecret }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ . | quote }}
                  key: {{ $v.model.hub.tokenSecretKey | quote }}
            {{- end }}
            {{- end }}
            # the kernel tuner's picks (GPU): writable even when the model cache is the
            # image's read-only copy, so container restarts skip the measurement
            - name: PDSERVE_KERNEL_TUNING_DIR
              value: /home/pdserve/kernel_tuning
            {{- if ne $v.model.cache.type "image" }}
            # compiled Triton kernels on the model cache volume: with a pvc, compiled once
            # for every pod instead of during each new pod's first requests
            - name: TRITON_CACHE_DIR
              value: {{ printf "%s/triton" $v.model.cache.path | quote }}
            {{- end }}
            - name: GLOG_minloglevel
              value: {{ $v.kvTransfer.logLevel | toString | quote }}
            # Mooncake's listen ports, the range the NetworkPolicy opens between workers
            - name: MC_MIN_RPC_PORT
              value: {{ $v.kvTransfer.portRange.min | int | quote }}
            - name: MC_MAX_RPC_PORT
              value: {{ $v.kvTransfer.portRange.max | int | quote }}
            - name: TOKENIZERS_PARALLELISM
              value: "false"
            {{- if eq $v.kvTransfer.protocol "nvlink_intra" }}
            # without it Mooncake silently falls back to TCP
            - name: MC_INTRANODE_NVLINK
              value: "1"
            {{- end }}
            {{- if $v.tls.enabled }}
            {{- include "pdserve.tls.healthcheckEnv" $root | nindent 12 }}
            {{- end }}
            {{- with $w.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $w.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $w.metricsPort }}
              protocol: TCP
          # grpc.health.v1 answers NOT_SERVING until the model is loaded: the startup probe
          # gives the load periodSeconds x failureThreshold, then readiness / liveness take over.
          {{- $probe := include "pdserve.tls.probeHandler" (dict "root" $root "port" $w.port) }}
          startupProbe:
            {{- $probe | nindent 12 }}
            {{- toYaml $w.probes.startup | nindent 12 }}
          readinessProbe:
            {{- $probe | nindent 12 }}
            {{- toYaml $w.probes.readiness | nindent 12 }}
          livenessProbe:
            {{- $probe | nindent 12 }}
            {{- toYaml $w.probes.liveness | nindent 12 }}
          resources:
            {{- toYaml $res | nindent 12 }}
          {{- with $sc }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: home
              mountPath: /home/pdserve
            # NCCL between tensor-parallel ranks uses /dev/shm (shmSize)
            - name: shm
              mountPath: /dev/shm
            {{- if not (has $v.model.source (list "bundled" "hub")) }}
            - name: model
              mountPath: {{ $v.model.mountPath }}
              {{- if and (eq $v.model.source "pvc") $v.model.pvc.subPath }}
              subPath: {{ $v.model.pvc.subPath | quote }}
              {{- end }}
              readOnly: true
            {{- end }}
            {{- if ne $v.model.cache.type "image" }}
            - name: model-cache
              mountPath: {{ $v.model.cache.path }}
            {{- end }}
            {{- if $hugepages }}
            - name: hugepages
              mountPath: /dev/hugepages
            {{- end }}
            {{- if $v.tls.enabled }}
            {{- include "pdserve.tls.volumeMount" $root | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: home
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $w.shmSize }}
        {{- if eq $v.model.source "pvc" }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $v.model.pvc.claimName }}
            readOnly: true
        {{- else if eq $v.model.source "hostPath" }}
        - name: model
          hostPath:
            path: {{ required "model.hostPath.path is required when model.source is hostPath" $v.model.hostPath.path }}
            type: {{ $v.model.hostPath.type }}
        {{- end }}
        {{- if eq $v.model.cache.type "emptyDir" }}
        - name: model-cache
          emptyDir:
            sizeLimit: {{ $v.model.cache.sizeLimit }}
        {{- else if eq $v.model.cache.type "pvc" }}
        - name: model-cache
          persistentVolumeClaim:
            claimName: {{ required "model.cache.claimName is required when model.cache.type is pvc" $v.model.cache.claimName }}
        {{- end }}
        {{- if $hugepages }}
        - name: hugepages
          emptyDir:
            medium: HugePages-{{ $w.hugepages.size }}
        {{- end }}
        {{- if $v.tls.enabled }}
        {{- include "pdserve.tls.volume" $root | nindent 8 }}
        {{- end }}
---
# Headless: the router resolves this name to one address per ready pod.
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $w.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $w.metricsPort }}
      targetPort: metrics
      protocol: TCP
{{- if $w.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- include "pdserve.pdbSpec" $w.podDisruptionBudget | trim | nindent 2 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- if $w.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ $w.autoscaling.minReplicas }}
  maxReplicas: {{ $w.autoscaling.maxReplicas }}
  metrics:
    {{- include "pdserve.hpaMetrics" $w.autoscaling | nindent 4 }}
{{- end }}
{{- if $v.monitoring.podMonitor.enabled }}
---
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
    {{- with $v.monitoring.podMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  podMetricsEndpoints:
    - port: metrics
      path: /metrics
      interval: {{ $v.monitoring.podMonitor.interval }}
{{- end }}
{{- end }}
