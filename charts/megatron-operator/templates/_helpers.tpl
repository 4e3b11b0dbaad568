{{/* Names, labels and the RBAC rules shared by the ClusterRole and the Roles. */}}

{{- define "megatron-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "megatron-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "megatron-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "megatron-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The pods of MegatronInference NetworkPolicies admit the operator by this label. */}}
{{- define "megatron-operator.selectorLabels" -}}
app.kubernetes.io/name: megatron-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "megatron-operator.labels" -}}
{{ include "megatron-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: megatron-serve
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "megatron-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "megatron-operator.tokenSecretName" -}}
{{- default (printf "%s-token-key" (include "megatron-operator.fullname" .)) .Values.operator.tokenKey.existingSecret -}}
{{- end -}}

{{- define "megatron-operator.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- join "," .Values.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "megatron-operator.peeringName" -}}
{{- default (include "megatron-operator.fullname" .) .Values.peering.name -}}
{{- end -}}

{{/*
kopf's peering: the replicas' keep-alives (megatron_operator/kube.py PEERING_PERMISSIONS), in a
ClusterKopfPeering for an operator of every namespace, else a KopfPeering per served namespace.
*/}}
{{- define "megatron-operator.peeringRules" -}}
{{- if .Values.peering.enabled }}
- apiGroups: ["kopf.dev"]
  resources: [{{ ternary "clusterkopfpeerings" "kopfpeerings" (eq .Values.rbac.scope "cluster") | quote }}]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end -}}

{{/*
Every API call of the operator (megatron_operator/kube.py PERMISSIONS; a test keeps them equal).
The CRD rule is cluster-scoped and only granted with rbac.scope=cluster.
*/}}
{{- define "megatron-operator.rules" -}}
# kopf: watch MegatronInferences, add its finalizer and progress annotations, write status
- apiGroups: ["serving.megatron.dev"]
  resources: ["megatroninferences"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["serving.megatron.dev"]
  resources: ["megatroninferences/status"]
  verbs: ["patch"]
# Kubernetes Events for every transition
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# children: read, create, patch what differs; engine groups are listed and deleted on scale-down
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# the fleet's disruption budgets (spec.disruptionBudget), which a node drain obeys; deleted when disabled
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# engine groups with spec.engine.parallelism: LeaderWorkerSets where the cluster has the CRD; their pods are
# listed for status.groups, and a StatefulSet gang's other pods are deleted when one rank restarts
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "delete"]
{{- end -}}
