{{/*
Helpers, all namespaced `kvshare.*`.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kvshare.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every resource name: fullnameOverride, else <release>-<chart>, else just <release>
when the release name already contains the chart name ("kvshare" gives "kvshare",
"kvshare-headless", "kvshare-redis"). Truncated to 54 so that the longest suffix ("-headless")
stays within the 63 characters of a DNS label.
*/}}
{{- define "kvshare.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvshare.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every resource's metadata (add a component label next to it). */}}
{{- define "kvshare.labels" -}}
helm.sh/chart: {{ include "kvshare.chart" . }}
{{ include "kvshare.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvshare
{{- end -}}

{{/* The labels that identify this release's pods; selectors add app.kubernetes.io/component. */}}
{{- define "kvshare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvshare.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector of the worker pods: the Services, the PDB and the Redis NetworkPolicy use it. */}}
{{- define "kvshare.workerSelectorLabels" -}}
{{ include "kvshare.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end -}}

{{/* Selector of the router pods (router.enabled). */}}
{{- define "kvshare.routerSelectorLabels" -}}
{{ include "kvshare.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Selector of the built-in Redis pod. */}}
{{- define "kvshare.redisSelectorLabels" -}}
{{ include "kvshare.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "kvshare.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvshare.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvshare.headlessName" -}}
{{- printf "%s-headless" (include "kvshare.fullname" .) -}}
{{- end -}}

{{- define "kvshare.routerName" -}}
{{- printf "%s-router" (include "kvshare.fullname" .) -}}
{{- end -}}

{{- define "kvshare.redisName" -}}
{{- printf "%s-redis" (include "kvshare.fullname" .) -}}
{{- end -}}

{{/* The worker image: repository:tag, with gpu.imageTagSuffix when gpu.enabled. */}}
{{- define "kvshare.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.gpu.enabled -}}
{{- $tag = printf "%s%s" $tag .Values.gpu.imageTagSuffix -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/*
A `kvshare serve` setting as the string its KVSHARE_* variable holds. Helm reads numbers in
values files as float64, which print as 5.36870912e+08; whole numbers are printed as integers so
that Python's int() accepts them.
*/}}
{{- define "kvshare.settingValue" -}}
{{- $v := . -}}
{{- if and (kindIs "float64" $v) (eq (floor $v) $v) -}}
{{- printf "%d" (int64 $v) -}}
{{- else -}}
{{- toString $v -}}
{{- end -}}
{{- end -}}

{{/*
The worker's cache URL (KVSHARE_CACHE_URL): the built-in Redis Service, or redis.url; with
"tiered+" when redis.tiered; with ":$(REDIS_PASSWORD)@" after the scheme (or after a user name
already in the URL) when redis.auth.existingSecret is set: Kubernetes expands $(REDIS_PASSWORD)
from the env entry defined before it, so the password never appears in a manifest. With
redis.tls.existingCASecret, ssl_ca_certs points at the mounted CA file.
*/}}
{{- define "kvshare.cacheURL" -}}
{{- $url := .Values.redis.url -}}
{{- if .Values.redis.builtIn.enabled -}}
{{- $url = printf "redis://%s:%d/0" (include "kvshare.redisName" .) (int .Values.redis.builtIn.port) -}}
{{- end -}}
{{- if and .Values.redis.tiered (not (hasPrefix "tiered+" $url)) -}}
{{- $url = printf "tiered+%s" $url -}}
{{- end -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- $parts := splitn "://" 2 $url -}}
{{- $rest := $parts._1 -}}
{{- if regexMatch "^[^/@]*@" $rest -}}
{{- $rest = regexReplaceAll "^([^/@:]*)(:[^/@]*)?@" $rest "${1}:$$(REDIS_PASSWORD)@" -}}
{{- else -}}
{{- $rest = printf ":$(REDIS_PASSWORD)@%s" $rest -}}
{{- end -}}
{{- $url = printf "%s://%s" $parts._0 $rest -}}
{{- end -}}
{{- if .Values.redis.tls.existingCASecret -}}
{{- $url = printf "%s%sssl_ca_certs=%s/%s" $url (ternary "&" "?" (contains "?" $url)) (include "kvshare.redisCADir" .) .Values.redis.tls.caKey -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{- define "kvshare.redisCADir" -}}
/etc/kvshare/redis-ca
{{- end -}}

{{/*
Seconds between the kubelet's TERM and its KILL: preStop sleep, NOT_SERVING window and drain,
plus a margin; terminationGracePeriodSeconds when set (checked to be no shorter).
*/}}
{{- define "kvshare.minGraceSeconds" -}}
{{- $c := .Values.config -}}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (ceil (default 2 $c.not_serving_s) | int) (ceil (default 20 $c.drain_s) | int) 5 -}}
{{- end -}}

{{- define "kvshare.graceSeconds" -}}
{{- $min := include "kvshare.minGraceSeconds" . | int -}}
{{- $set := .Values.lifecycle.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $set -}}
{{- $min -}}
{{- else if lt (int $set) $min -}}
{{- fail (printf "lifecycle.terminationGracePeriodSeconds=%d is shorter than preStopSleepSeconds + config.not_serving_s + config.drain_s + 5 = %d: the kubelet would kill streams mid-drain" (int $set) $min) -}}
{{- else -}}
{{- int $set -}}
{{- end -}}
{{- end -}}

{{/*
The router's seconds between TERM and KILL: the workers' preStop sleep, then its own NOT_SERVING
window and drain, plus a margin.
*/}}
{{- define "kvshare.routerGraceSeconds" -}}
{{- $c := .Values.router.config -}}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (ceil (default 2 $c.not_serving_s) | int) (ceil (default 20 $c.drain_s) | int) 5 -}}
{{- end -}}

{{/* Combinations of values that the schema cannot express; each fails the render with a reason. */}}
{{- define "kvshare.validate" -}}
{{- $r := .Values.redis -}}
{{- if and $r.builtIn.enabled $r.url -}}
{{- fail "redis.url is set while redis.builtIn.enabled is true: choose one (set redis.builtIn.enabled=false to use an external Redis)" -}}
{{- end -}}
{{- if and (not $r.builtIn.enabled) (not $r.url) -}}
{{- fail "redis.builtIn.enabled is false and redis.url is empty: give the external Redis URL (redis://, rediss://, unix://, redis+cluster://, optionally tiered+)" -}}
{{- end -}}
{{- if and $r.tls.existingCASecret (not (contains "rediss" (include "kvshare.cacheURL" .))) -}}
{{- fail "redis.tls.existingCASecret needs a TLS URL (rediss:// or rediss+cluster://)" -}}
{{- end -}}
{{- $m := .Values.model -}}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) -}}
{{- fail "model.source=pvc needs model.pvc.claimName" -}}
{{- end -}}
{{- if eq $m.source "image" -}}
{{- if not $m.image.reference -}}
{{- fail "model.source=image needs model.image.reference" -}}
{{- end -}}
{{- if not (semverCompare ">=1.31.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "model.source=image needs Kubernetes 1.31+ (the ImageVolume feature); this cluster is %s (helm template: pass --kube-version)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (not (dig "requests" "cpu" "" .Values.resources)) -}}
{{- fail "autoscaling.enabled targets CPU utilisation, which needs resources.requests.cpu" -}}
{{- end -}}
{{- $_ := include "kvshare.graceSeconds" . -}}
{{- end -}}

{{/* redis-server options of the built-in Redis (after --port). */}}
{{- define "kvshare.redisArgs" -}}
{{- $redis := .Values.redis.builtIn -}}
--maxmemory {{ $redis.maxmemory }} --maxmemory-policy {{ $redis.maxmemoryPolicy }}
{{- if $redis.persistence.enabled }} --save "" --appendonly yes --dir /data
{{- else }} --save "" --appendonly no
{{- end }}
{{- end -}}

{{/*
The security files the workers read: one entry per configured security.* Secret, with the
environment variable that names the file and the folder it is mounted in.
*/}}
{{- define "kvshare.securityFiles" -}}
{{- $env := dict "signingKeys" "KVSHARE_CACHE_SIGNING_KEY_FILE" "namespaceSecret" "KVSHARE_CACHE_NAMESPACE_SECRET_FILE" "apiKeys" "KVSHARE_API_KEYS_FILE" -}}
{{- $files := list -}}
{{- range $name := keys $env | sortAlpha -}}
{{- $s := get $.Values.security $name -}}
{{- if $s.existingSecret -}}
{{- $files = append $files (dict "volume" (printf "security-%s" ($name | kebabcase)) "env" (get $env $name) "secret" $s.existingSecret "key" $s.key "dir" (printf "/etc/kvshare/%s" ($name | kebabcase))) -}}
{{- end -}}
{{- end -}}
{{- toYaml $files -}}
{{- end -}}
