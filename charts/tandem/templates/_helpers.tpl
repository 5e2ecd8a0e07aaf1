{{/* The release's full name: the release name, with the chart's name added unless it is already in it. */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: the existing ServiceAccount to run the operator as (serviceAccount.create is false)" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tandem.workerImage" -}}
{{- printf "%s:%s" .Values.workerImage.repository (default .Chart.AppVersion .Values.workerImage.tag) -}}
{{- end -}}

{{/* The kopf peering object's name, when replicas > 1 peer through kopf (leader election off). */}}
{{- define "tandem.peering" -}}
{{- include "tandem.fullname" . -}}
{{- end -}}

{{/* Whether replicas coordinate through kopf's peering: more than one, and no leader election. */}}
{{- define "tandem.peered" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) }}true{{ end -}}
{{- end -}}

{{/* The leader election's Lease: named after the release, in its namespace. */}}
{{- define "tandem.lease" -}}
{{- include "tandem.fullname" . -}}
{{- end -}}

{{/*
What the operator may do in the namespaces it watches: one list of rules, used by the ClusterRole (every
namespace) or by a Role in each watched namespace. Exact verbs, from what the operator calls:
*/}}
{{- define "tandem.namespacedRules" -}}
# Its own resources: kopf lists and watches them and patches its annotations and finalizer on them; the operator
# patches their status (the status subresource) and deletes a finished job when its TTL has passed. get on
# paralleltrainingjobs and their status, with patch, is what each job's rank-0 Role grants, and get and watch on
# inferencepools what each pool's server Role grants (its servers read their pool's batching settings): Kubernetes
# lets the operator create those Roles only because it holds those verbs itself.
- apiGroups: [tandem.dev]
  resources: [paralleltrainingjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [tandem.dev]
  resources: [paralleltrainingjobs/status]
  verbs: [get, patch]
- apiGroups: [tandem.dev]
  resources: [inferencepools]
  verbs: [get, list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [inferencepools/status]
  verbs: [patch]
# What it creates is owned by a job or pool with blockOwnerDeletion: where the OwnerReferencesPermissionEnforcement
# admission plugin is on, that needs update on the owner's finalizers.
- apiGroups: [tandem.dev]
  resources: [paralleltrainingjobs/finalizers, inferencepools/finalizers]
  verbs: [update]
# Rank pods, created and deleted a whole group at a time; rank pods and server pods are read from kopf's indices
# (list and watch), and a job waiting for its pods to go lists them to confirm the index (operator/daemon.py).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# A job's headless Service and spec ConfigMap (created; the ConfigMap replaced when it exists); a pool's Service,
# spec ConfigMap and server Deployment (created, or replaced when the pool changes).
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [list, watch, create, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, update]
# A pool's PodDisruptionBudget (more than one replica) and HorizontalPodAutoscaler (spec.autoscaling): deleted
# when the pool no longer wants them.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, update, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch, create, update, delete]
# Rank 0's ServiceAccount, Role and RoleBinding (get and patch on its one job): created once, removed with the job
# by owner references.
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create]
# The Events the operator posts on jobs and pools (kopf posts core/v1 Events only).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.kueue.enabled }}
# Kueue (kueue.enabled, tandem operator --kueue): a queued job's Workload is created, read from kopf's index (list,
# watch), deleted when the job leaves its queue or its group changes, and its status patched (quota given back after
# an eviction, PodsReady, Finished).
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, watch, create, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end }}
{{- if .Values.gangScheduling.enabled }}
# Gang scheduling (gangScheduling.enabled, tandem operator --gang-scheduling): a job's PodGroup, created with its
# group and its spec patched when a later group's size differs.
- apiGroups: [scheduling.x-k8s.io, scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [create, patch]
{{- end }}
{{- if and (include "tandem.peered" .) .Values.watchNamespaces }}
# kopf's peering: each replica's keep-alive in the KopfPeering of every namespace it watches.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}

{{/* What kopf reads cluster-wide, whatever it watches: CRDs (to notice its resources' definitions change) and,
when it watches named namespaces, the namespaces themselves; with Kueue, the cluster-scoped objects it reads. */}}
{{- define "tandem.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.kueue.enabled }}
# Kueue: the admitted flavours' node labels and tolerations, and the priority class a Workload's priority is read
# from (cluster-scoped, read when the Workload is created or admitted).
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors, workloadpriorityclasses]
  verbs: [get]
- apiGroups: [scheduling.k8s.io]
  resources: [priorityclasses]
  verbs: [get]
{{- end }}
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- else if include "tandem.peered" . }}
# kopf's peering: each replica's keep-alive in the ClusterKopfPeering.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
