{{/* The image of every container. */}}
{{- define "gpu-vm-node.image" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end }}

{{/* The labels of a daemon's objects; the argument is the daemon's name. */}}
{{- define "gpu-vm-node.labels" -}}
app.kubernetes.io/name: {{ . }}
app.kubernetes.io/part-of: gpu-vm-node
{{- end }}

{{/* The service-account user of a daemon: (list $ name). */}}
{{- define "gpu-vm-node.user" -}}
system:serviceaccount:{{ (index . 0).Release.Namespace }}:{{ index . 1 }}
{{- end }}

{{/*
The pod spec's scheduling: (dict "root" $ "workloads" (list ...) "operand" NAME). The node's
nvidia.com/gpu.workload.config is one of workloads; with an operand, the GPU Operator's
nvidia.com/gpu.deploy.<operand> is not "false" nor a pause value.
*/}}
{{- define "gpu-vm-node.scheduling" -}}
{{- $v := .root.Values -}}
priorityClassName: {{ $v.priorityClassName }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - key: nvidia.com/gpu.workload.config
              operator: In
              values: {{ toJson .workloads }}
            {{- with .operand }}
            # The GPU Operator's opt-out and pauses: not where this label is "false",
            # paused-for-vgpu-change or paused-for-driver-upgrade (absent or "true": on).
            - key: nvidia.com/gpu.deploy.{{ . }}
              operator: NotIn
              values: ["false", "paused-for-vgpu-change", "paused-for-driver-upgrade"]
            {{- end }}
            {{- with $v.nodeAffinityExpressions }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A container's metrics port and probes: the port number. */}}
{{- define "gpu-vm-node.probes" -}}
ports:
  - name: metrics
    containerPort: {{ . }}
    protocol: TCP
# /healthz: the process serves (liveness); /readyz: its first pass succeeded.
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: 10
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  periodSeconds: 10
{{- end }}

{{/* A daemon's metrics Service: (list $ name port). */}}
{{- define "gpu-vm-node.service" -}}
{{- $name := index . 1 -}}
# The metrics port (Prometheus text at /metrics); the chart's ServiceMonitor
# (metrics.serviceMonitor.enabled) selects the Services labelled app.kubernetes.io/component=metrics.
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}-metrics
  namespace: {{ (index . 0).Release.Namespace }}
  labels:
    {{- include "gpu-vm-node.labels" $name | nindent 4 }}
    app.kubernetes.io/component: metrics
spec:
  clusterIP: None
  selector:
    app.kubernetes.io/name: {{ $name }}
  ports:
    - name: metrics
      port: {{ index . 2 }}
      targetPort: metrics
      protocol: TCP
{{- end }}

{{/* A daemon's ServiceAccount and its ClusterRole and binding: (list $ name rules). */}}
{{- define "gpu-vm-node.rbac" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpu-vm-node.labels" $name | nindent 4 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: gpu-vm-node-{{ $name }}
  labels:
    {{- include "gpu-vm-node.labels" $name | nindent 4 }}
rules:
  {{- with index . 2 }}
  {{- . | nindent 2 }}
  {{- end }}
  # Events about its Node (events.k8s.io, and the core group's for older clients).
  - apiGroups: [events.k8s.io, ""]
    resources: [events]
    verbs: [create, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: gpu-vm-node-{{ $name }}
  labels:
    {{- include "gpu-vm-node.labels" $name | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: gpu-vm-node-{{ $name }}
subjects:
  - kind: ServiceAccount
    name: {{ $name }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}

{{/* The common environment: NODE_NAME, HOST_ROOT, KUBELET_DIR. */}}
{{- define "gpu-vm-node.env" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: HOST_ROOT
  value: /host
# kubelet's device-plugin directory; its PodResources socket is found beside it
# (pod-resources/kubelet.sock). kubeletDir moves both, and their mounts, for a kubelet whose root
# is not /var/lib/kubelet.
- name: KUBELET_DIR
  value: /host{{ .Values.kubeletDir }}/device-plugins
{{- end }}

{{/*
A path of the node's own filesystem (not kubelet's directory): (list $ "/sys"). hostRoot is "/"
on every real node; a simulated node is a directory.
*/}}
{{- define "gpu-vm-node.hostPath" -}}
{{- $root := trimSuffix "/" (index . 0).Values.hostRoot -}}
{{- printf "%s%s" $root (index . 1) -}}
{{- end }}

{{/*
sandbox-dp --on-demand: before a vGPU goes, whether the pod kubelet no longer lists still runs on
the node (a restarted kubelet lists no pod until it has read its pods from the API server).
*/}}
{{- define "gpu-vm-node.onDemandPodsRule" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [get]
{{- end }}
