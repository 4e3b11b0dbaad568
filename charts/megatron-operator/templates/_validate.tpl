{{/*
Refusals of values the chart would otherwise act on wrongly or override without a word; deployment.yaml includes
this before it renders anything.
*/}}

{{/*
The `kopf run` options the chart sets from its values, each with the value that carries it: an operator.extraArgs
entry naming one would contradict the chart (two peering modes, a namespace the RBAC does not cover, probes on
another port) or be undone by it (the operator takes its peering priority from the chart's environment, after
kopf's --priority). Each is [long option, short option or "", the value to set instead].
*/}}
{{- define "megatron-operator.ownedOptions" -}}
{{- list
  (list "--standalone" "" "peering.enabled")
  (list "--peering" "-P" "peering.enabled and peering.name")
  (list "--priority" "-p" "peering.priority")
  (list "--dev" "" "peering.priority")
  (list "--liveness" "-L" "healthPort")
  (list "--namespace" "-n" "rbac.scope and watchNamespaces")
  (list "--all-namespaces" "-A" "rbac.scope")
  (list "--verbose" "-v" "operator.logLevel")
  (list "--debug" "-d" "operator.logLevel")
  (list "--quiet" "-q" "operator.logLevel")
  | toJson -}}
{{- end -}}

{{/*
The environment variables the chart sets: a later entry of the same name (operator.extraEnv comes last) would
replace the chart's, so the value that sets it would silently stop working.
*/}}
{{- define "megatron-operator.ownedEnv" -}}
{{- list
  (list "MEGATRON_OPERATOR_DEFAULT_IMAGE" "set operator.defaultImage instead")
  (list "MEGATRON_OPERATOR_TOKEN_KEY" "set operator.tokenKey instead")
  (list "MEGATRON_OPERATOR_RECONCILE_INTERVAL" "set operator.reconcileIntervalSeconds instead")
  (list "MEGATRON_OPERATOR_CONNECT_TIMEOUT" "set operator.connectTimeoutSeconds instead")
  (list "MEGATRON_OPERATOR_COMMAND_TIMEOUT" "set operator.commandTimeoutSeconds instead")
  (list "MEGATRON_OPERATOR_LEADER_WORKER_SET" "set operator.leaderWorkerSet instead")
  (list "MEGATRON_OPERATOR_POD_LABELS" "it names the labels the chart gives the operator's pods")
  (list "MEGATRON_OPERATOR_SCANNING" "set rbac.scope instead")
  (list "HOME" "it points at the container's writable /tmp")
  (list "POD_ID" "kopf names each peer by it, the replica's pod name")
  (list "MEGATRON_OPERATOR_PEERING_PRIORITY" "set peering.priority instead")
  (list "MEGATRON_OPERATOR_PEERING_LIFETIME" "set peering.lifetimeSeconds instead")
  | toJson -}}
{{- end -}}

{{- define "megatron-operator.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) }}
{{- fail (printf "replicaCount: %d operators would all act on every resource; set peering.enabled=true (kopf's peering keeps one acting) or replicaCount=1" (int .Values.replicaCount)) }}
{{- end }}
{{- $priority := .Values.peering.priority }}
{{- if and .Values.peering.enabled (not (kindIs "string" $priority)) (gt (int .Values.replicaCount) 1) }}
{{- fail (printf "peering.priority: %d would give all %d replicas one priority, and kopf pauses every peer of equal priority, so none would act; use peering.priority=oldest-first with replicaCount above 1" (int64 $priority) (int .Values.replicaCount)) }}
{{- end }}
{{- range $arg := .Values.operator.extraArgs }}
{{- range $option := include "megatron-operator.ownedOptions" $ | fromJsonArray }}
{{- $long := index $option 0 }}
{{- $short := index $option 1 }}
{{- if or (eq $arg $long) (hasPrefix (printf "%s=" $long) $arg) (and $short (hasPrefix $short $arg) (not (hasPrefix "--" $arg))) }}
{{- fail (printf "operator.extraArgs: %q is an option the chart sets itself (%s); set %s instead" $arg $long (index $option 2)) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $entry := .Values.operator.extraEnv }}
{{- range $owned := include "megatron-operator.ownedEnv" $ | fromJsonArray }}
{{- if eq (toString $entry.name) (index $owned 0) }}
{{- fail (printf "operator.extraEnv: %s is a variable the chart sets itself (a second entry would replace it); %s" $entry.name (index $owned 1)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
