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

{{/*
The workers' HTTP API port on both Services (nothing while httpPort is 0): HTTPS when the gRPC
port has TLS, since the workers serve both with tls.existingSecret's certificate.
*/}}
{{- define "kvshare.workerHTTPServicePort" -}}
{{- with .Values.httpPort -}}
- name: http
  port: {{ . }}
  targetPort: http
  protocol: TCP
  appProtocol: {{ ternary "https" "http" (not (empty $.Values.tls.existingSecret)) }}
{{- end -}}
{{- end -}}

{{/*
NOTES.txt: calls of an HTTP API port through `kubectl port-forward`, given a dict of ns, service,
port and tls (the workers' HTTPS, which answers to the names of its certificate only).
*/}}
{{- define "kvshare.notesHTTPCalls" -}}
{{- $host := ternary "WORKER_NAME_IN_YOUR_CERTIFICATE" "localhost" .tls -}}
{{- $curl := "curl" -}}
{{- if .tls -}}
{{- $curl = printf "curl --cacert ca.crt%s --resolve %s:%d:127.0.0.1" (ternary " --cert client.crt --key client.key" "" .clientAuth) $host (int .port) -}}
{{- end -}}
{{- $url := printf "%s://%s:%d" (ternary "https" "http" .tls) $host (int .port) -}}
kubectl -n {{ .ns }} port-forward service/{{ .service }} {{ .port }}:{{ .port }} &
  {{ $curl }} -fsS {{ $url }}/health
  MODEL=$({{ $curl }} -fsS {{ $url }}/v1/models | jq -r '.data[0].id')
  {{ $curl }} -N {{ $url }}/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": true}'
{{- end -}}

{{- define "kvshare.redisName" -}}
{{- printf "%s-redis" (include "kvshare.fullname" .) -}}
{{- end -}}

{{/*
The worker image: repository:tag, with gpu.imageTagSuffix when gpu.enabled, and @digest when
image.digest is set (repository:tag@sha256:..., a valid reference whose digest decides).
*/}}
{{- define "kvshare.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.gpu.enabled -}}
{{- $tag = printf "%s%s" $tag .Values.gpu.imageTagSuffix -}}
{{- end -}}
{{- include "kvshare.imageRef" (dict "repository" .Values.image.repository "tag" $tag "digest" .Values.image.digest) -}}
{{- end -}}

{{/* The router's image: the CPU worker image (it runs no model), with router.image.digest, or
image.digest when the workers run that same CPU image. */}}
{{- define "kvshare.routerImage" -}}
{{- $digest := .Values.router.image.digest | default (ternary "" .Values.image.digest .Values.gpu.enabled) -}}
{{- include "kvshare.imageRef" (dict "repository" .Values.image.repository "tag" (default .Chart.AppVersion .Values.image.tag) "digest" $digest) -}}
{{- end -}}

{{/* The built-in Redis image. */}}
{{- define "kvshare.redisImage" -}}
{{- include "kvshare.imageRef" .Values.redis.builtIn.image -}}
{{- end -}}

{{- define "kvshare.imageRef" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- with .digest }}@{{ . }}{{ end -}}
{{- end -}}

{{/*
Seconds a draining worker gives its streams: config.drain_s, or the time a stream of
config.max_new_tokens_cap tokens takes at lifecycle.drainTokensPerSecond.
*/}}
{{- define "kvshare.drainSeconds" -}}
{{- $c := .Values.config -}}
{{- $needed := include "kvshare.streamSeconds" . | int -}}
{{- if kindIs "invalid" $c.drain_s -}}
{{- $needed -}}
{{- else if lt (float64 $c.drain_s) (float64 $needed) -}}
{{- fail (printf "config.drain_s=%v is shorter than the longest stream: max_new_tokens_cap %d tokens at lifecycle.drainTokensPerSecond %v take %d s, so rollouts and node drains would cut streams (raise drain_s, or leave it null to derive it)" $c.drain_s (int (default 4096 $c.max_new_tokens_cap)) .Values.lifecycle.drainTokensPerSecond $needed) -}}
{{- else -}}
{{- ceil $c.drain_s | int -}}
{{- end -}}
{{- end -}}

{{- define "kvshare.streamSeconds" -}}
{{- ceil (divf (default 4096 .Values.config.max_new_tokens_cap) .Values.lifecycle.drainTokensPerSecond) | int -}}
{{- end -}}

{{/*
failureThreshold of the liveness probe: the set one, or the smallest whose window
(periodSeconds x failureThreshold) outlasts NOT_SERVING + drain; a set one that does not fails.
*/}}
{{- define "kvshare.livenessFailureThreshold" -}}
{{- $p := .Values.probes.liveness -}}
{{- $busy := add (ceil (default 2 .Values.config.not_serving_s) | int) (include "kvshare.drainSeconds" . | int) -}}
{{- if kindIs "invalid" $p.failureThreshold -}}
{{- add (div $busy (int $p.periodSeconds)) 1 -}}
{{- else if le (mul (int $p.periodSeconds) (int $p.failureThreshold)) $busy -}}
{{- fail (printf "probes.liveness: periodSeconds x failureThreshold = %d s is not above config.not_serving_s + drain = %d s: a draining worker reports NOT_SERVING and would be killed mid-drain (leave failureThreshold null to derive it)" (mul (int $p.periodSeconds) (int $p.failureThreshold)) $busy) -}}
{{- else -}}
{{- int $p.failureThreshold -}}
{{- end -}}
{{- end -}}

{{/* ONNX Runtime threads: config.intra_op_threads, or resources.requests.cpu rounded up (at least 1). */}}
{{- define "kvshare.intraOpThreads" -}}
{{- $set := int .Values.config.intra_op_threads -}}
{{- if gt $set 0 -}}
{{- $set -}}
{{- else -}}
{{- $cpu := toString (dig "requests" "cpu" "1" .Values.resources) -}}
{{- $cores := 1.0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = divf (trimSuffix "m" $cpu | float64) 1000 -}}
{{- else -}}
{{- $cores = float64 $cpu -}}
{{- end -}}
{{- max 1 (ceil $cores | int) -}}
{{- end -}}
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
"tiered+" when redis.tiered. No password: the workers read it from the Secret mounted as a file
(KVSHARE_CACHE_PASSWORD_FILE), so it appears in no manifest and no environment. With a Redis CA,
ssl_ca_certs points at the mounted CA file.
*/}}
{{- define "kvshare.cacheURL" -}}
{{- $url := .Values.redis.url -}}
{{- if .Values.redis.builtIn.enabled -}}
{{- $url = printf "%s://%s:%d/0" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "kvshare.redisName" .) (int .Values.redis.builtIn.port) -}}
{{- end -}}
{{- if and .Values.redis.tiered (not (hasPrefix "tiered+" $url)) -}}
{{- $url = printf "tiered+%s" $url -}}
{{- end -}}
{{- with include "kvshare.redisCASecret" . | fromYaml -}}
{{- $url = printf "%s%sssl_ca_certs=%s/%s" $url (ternary "&" "?" (contains "?" $url)) (include "kvshare.redisCADir" $) .key -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{/*
The Secret holding the Redis password (key: redis.auth.existingSecretPasswordKey), or "" for none:
redis.auth.existingSecret, else for the built-in Redis the one the chart generates.
*/}}
{{- define "kvshare.redisPasswordSecret" -}}
{{- if .Values.redis.auth.enabled -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecret -}}
{{- else if .Values.redis.builtIn.enabled -}}
{{- printf "%s-auth" (include "kvshare.redisName" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The built-in Redis's certificate Secret (tls.crt, tls.key, ca.crt), or "" without TLS. */}}
{{- define "kvshare.redisTLSSecret" -}}
{{- if and .Values.redis.builtIn.enabled .Values.redis.tls.enabled -}}
{{- default (printf "%s-tls" (include "kvshare.redisName" .)) .Values.redis.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/*
The data of the Secrets the chart generates for the built-in Redis, as YAML {auth: {...}, tls: {...}}
(base64 values; a part is absent when an existing Secret is named or the feature is off): what the
cluster already holds (lookup), else made now. Made once per render and kept in .Values, so that
the Secrets and the pods' checksum annotations agree.
*/}}
{{- define "kvshare.redisGenerated" -}}
{{- if not (hasKey .Values "kvshareGeneratedRedis") -}}
{{- $out := dict -}}
{{- $name := include "kvshare.redisName" . -}}
{{- $ns := .Release.Namespace -}}
{{- if and .Values.redis.builtIn.enabled .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret) -}}
{{- $key := .Values.redis.auth.existingSecretPasswordKey -}}
{{- $password := randAlphaNum 40 | b64enc -}}
{{- with lookup "v1" "Secret" $ns (printf "%s-auth" $name) -}}
{{- $password = get (default dict .data) $key | default $password -}}
{{- end -}}
{{- $_ := set $out "auth" (dict $key $password) -}}
{{- end -}}
{{- if and .Values.redis.builtIn.enabled .Values.redis.tls.enabled (not .Values.redis.tls.existingSecret) -}}
{{- $data := dict -}}
{{- with lookup "v1" "Secret" $ns (printf "%s-tls" $name) -}}
{{- $data = default dict .data -}}
{{- end -}}
{{- if not (and (get $data "ca.crt") (get $data "tls.crt") (get $data "tls.key")) -}}
{{- $ca := genCA (printf "%s-ca" $name) 3650 -}}
{{- $hosts := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) (printf "*.%s-headless.%s.svc" $name $ns) (printf "*.%s-headless.%s.svc.cluster.local" $name $ns) "localhost" -}}
{{- $cert := genSignedCert $name nil $hosts 3650 $ca -}}
{{- $data = dict "ca.crt" ($ca.Cert | b64enc) "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) -}}
{{- end -}}
{{- $_ := set $out "tls" $data -}}
{{- end -}}
{{- $_ := set .Values "kvshareGeneratedRedis" $out -}}
{{- end -}}
{{- toYaml .Values.kvshareGeneratedRedis -}}
{{- end -}}

{{/* Pod annotation that rolls the pods when a generated Redis Secret changes (its data is read at start). */}}
{{- define "kvshare.redisSecretsChecksum" -}}
{{- with include "kvshare.redisGenerated" . | fromYaml -}}
checksum/redis-secrets: {{ toYaml . | sha256sum }}
{{- end -}}
{{- end -}}

{{/* The CA the workers check Redis's certificate with, as YAML {name, key}; "" for the system's. */}}
{{- define "kvshare.redisCASecret" -}}
{{- if .Values.redis.tls.existingCASecret -}}
{{- toYaml (dict "name" .Values.redis.tls.existingCASecret "key" .Values.redis.tls.caKey) -}}
{{- else if include "kvshare.redisTLSSecret" . -}}
{{- toYaml (dict "name" (include "kvshare.redisTLSSecret" .) "key" "ca.crt") -}}
{{- end -}}
{{- end -}}

{{- define "kvshare.redisCADir" -}}
/etc/kvshare/redis-ca
{{- end -}}

{{/* Where the Redis password Secret is mounted, in the workers and in the built-in Redis. */}}
{{- define "kvshare.redisAuthDir" -}}
/etc/kvshare/redis-auth
{{- end -}}

{{/*
Seconds between the kubelet's TERM and its KILL: preStop sleep, NOT_SERVING window and drain,
plus a margin; terminationGracePeriodSeconds when set (checked to be no shorter).
*/}}
{{- define "kvshare.minGraceSeconds" -}}
{{- $c := .Values.config -}}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (ceil (default 2 $c.not_serving_s) | int) (include "kvshare.drainSeconds" . | int) 5 -}}
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
window and drain (null: the workers' drain, since the streams it forwards are theirs), plus a margin.
*/}}
{{- define "kvshare.routerGraceSeconds" -}}
{{- $c := .Values.router.config -}}
{{- $drain := ternary (include "kvshare.drainSeconds" . | int) (ceil $c.drain_s | int) (kindIs "invalid" $c.drain_s) -}}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (ceil (default 2 $c.not_serving_s) | int) $drain 5 -}}
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
{{- if and $r.tls.existingCASecret $r.builtIn.enabled -}}
{{- fail "redis.tls.existingCASecret is for an external Redis: the built-in Redis's CA comes with its certificate (redis.tls.existingSecret's ca.crt, or the generated one)" -}}
{{- end -}}
{{- if and $r.tls.existingCASecret (not (regexMatch "^(tiered\\+)?rediss(\\+cluster)?://" (include "kvshare.cacheURL" .))) -}}
{{- fail "redis.tls.existingCASecret needs a TLS URL (rediss:// or rediss+cluster://)" -}}
{{- end -}}
{{- $urlHead := regexReplaceAll "[?#].*$" $r.url "" -}}
{{- if or (regexMatch "://[^@]*:[^@]*@" $urlHead) (regexMatch "(?i)[?&]password=" $r.url) -}}
{{- fail "redis.url holds a password, which would sit in the release's values and the pod spec: put it in a Secret and name it in redis.auth.existingSecret" -}}
{{- end -}}
{{- if regexMatch "(?i)[?&](ssl_cert_reqs|ssl_check_hostname|ssl_ca_certs)=" $r.url -}}
{{- fail "redis.url sets ssl_cert_reqs, ssl_check_hostname or ssl_ca_certs: the workers always check the Redis certificate, against redis.tls.existingCASecret (a private CA) or the system's CAs" -}}
{{- end -}}
{{- if contains "#" $r.url -}}
{{- fail "redis.url has a #fragment, which a Redis URL has no use for" -}}
{{- end -}}
{{- if not $r.builtIn.enabled -}}
{{- if and $r.auth.enabled (not $r.auth.existingSecret) -}}
{{- fail "redis.auth.enabled: the external Redis's password must come from a Secret: set redis.auth.existingSecret (and existingSecretPasswordKey), or redis.auth.enabled=false for a Redis without a password, which anyone who reaches it can write" -}}
{{- end -}}
{{- if and $r.tls.enabled (not (regexMatch "^(tiered\\+)?(rediss|rediss\\+cluster|unix)://" $r.url)) -}}
{{- fail (printf "redis.tls.enabled: redis.url %s is plaintext: use rediss:// (or rediss+cluster://), or set redis.tls.enabled=false to send K/V and the password in the clear" $r.url) -}}
{{- end -}}
{{- end -}}
{{- if $r.builtIn.enabled -}}
{{- $limit := dig "limits" "memory" "" $r.builtIn.resources -}}
{{- if not $limit -}}
{{- fail "redis.builtIn.resources.limits.memory is required: Redis must be bounded above redis.builtIn.maxmemory" -}}
{{- end -}}
{{- $max := include "kvshare.redisBytes" $r.builtIn.maxmemory | float64 -}}
{{- $need := mulf $max (ternary 2.0 1.25 $r.builtIn.persistence.enabled) -}}
{{- $have := include "kvshare.quantityBytes" $limit | float64 -}}
{{- if lt $have $need -}}
{{- fail (printf "redis.builtIn.resources.limits.memory %v must be at least %s redis.builtIn.maxmemory %s%s" $limit (ternary "twice" "1.25 times" $r.builtIn.persistence.enabled) $r.builtIn.maxmemory (ternary ": with persistence, an AOF rewrite forks Redis and copied pages count twice" ": Redis needs room beyond the data it holds (buffers, fragmentation)" $r.builtIn.persistence.enabled)) -}}
{{- end -}}
{{- end -}}
{{- $ports := list (int .Values.port) -}}
{{- if .Values.httpPort }}{{ $ports = append $ports (int .Values.httpPort) }}{{ end -}}
{{- if .Values.metrics.enabled }}{{ $ports = append $ports (int .Values.metrics.port) }}{{ end -}}
{{- if .Values.tls.existingSecret }}{{ $ports = append $ports (int .Values.tls.healthPort) }}{{ end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "port, httpPort, metrics.port and tls.healthPort must differ (got %v): each is its own listener, fenced differently" $ports) -}}
{{- end -}}
{{- if and .Values.router.enabled (eq (int .Values.router.port) (int .Values.router.httpPort)) -}}
{{- fail (printf "router.port and router.httpPort must differ (both %d): gRPC and the HTTP API are two listeners" (int .Values.router.port)) -}}
{{- end -}}
{{- if and .Values.router.enabled .Values.tls.existingSecret -}}
{{- fail "router.enabled with tls.existingSecret: the router dials the workers in plaintext; turn one of them off" -}}
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
{{- if and .Values.autoscaling.enabled (not .Values.metrics.enabled) -}}
{{- fail "autoscaling.enabled scales on the workers' kvshare_requests_in_flight, which metrics.enabled=false turns off: enable metrics (only metrics.scrapers reach them)" -}}
{{- end -}}
{{- $redisImage := .Values.redis.builtIn.image -}}
{{- if and (eq $redisImage.digest "sha256:3b73847e72874be07e6657b129a94761662b79bc0f679273757d4218573b2a98") (ne $redisImage.tag "7.4.6-alpine") -}}
{{- fail (printf "redis.builtIn.image.tag=%s with the digest pinned for 7.4.6-alpine would still run 7.4.6: set redis.builtIn.image.digest to the new tag's digest (docker buildx imagetools inspect redis:%s), or \"\" to follow the tag" $redisImage.tag $redisImage.tag) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (include "kvshare.cpuFallback" .) (not (dig "requests" "cpu" "" .Values.resources)) -}}
{{- fail "autoscaling.cpuFallback targets CPU utilisation, which needs resources.requests.cpu" -}}
{{- end -}}
{{- $_ := include "kvshare.graceSeconds" . -}}
{{- $_ = include "kvshare.livenessFailureThreshold" . -}}
{{- end -}}

{{/*
redis-server options of the built-in Redis. Values are megabytes of K/V: freeing one on eviction
or expiry in the main thread would stall every other client, so it is done lazily.
*/}}
{{- define "kvshare.redisArgs" -}}
{{- $redis := .Values.redis.builtIn -}}
{{- if .Values.redis.tls.enabled -}}
--port 0 --tls-port {{ $redis.port }} --tls-cert-file /tls/tls.crt --tls-key-file /tls/tls.key --tls-ca-cert-file /tls/ca.crt --tls-auth-clients no
{{- else -}}
--port {{ $redis.port }}
{{- end }} --maxmemory {{ $redis.maxmemory }} --maxmemory-policy {{ $redis.maxmemoryPolicy }}
{{- ""}} --lazyfree-lazy-eviction yes --lazyfree-lazy-expire yes --lazyfree-lazy-server-del yes --lazyfree-lazy-user-del yes
{{- if $redis.persistence.enabled }} --save "" --appendonly yes --dir /data
{{- else }} --save "" --appendonly no
{{- end }}
{{- end -}}

{{/* A Redis memory size (1gb, 512mb, 100k, 1024) in bytes, as Redis reads it (k = 1000, kb = 1024). */}}
{{- define "kvshare.redisBytes" -}}
{{- $m := regexFindAll "^([0-9]+)([a-zA-Z]*)$" (lower (toString .)) 1 | first | default "0" -}}
{{- $n := regexReplaceAll "[a-z]+$" $m "" | float64 -}}
{{- $unit := regexReplaceAll "^[0-9]+" $m "" -}}
{{- $scale := get (dict "" 1.0 "b" 1.0 "k" 1e3 "kb" 1024.0 "m" 1e6 "mb" 1048576.0 "g" 1e9 "gb" 1073741824.0) $unit -}}
{{- mulf $n $scale -}}
{{- end -}}

{{/* A Kubernetes memory quantity (1536Mi, 2Gi, 1G, 500M, 1073741824) in bytes. */}}
{{- define "kvshare.quantityBytes" -}}
{{- $q := toString . -}}
{{- $n := regexFind "^[0-9.]+" $q | float64 -}}
{{- $unit := regexReplaceAll "^[0-9.]+" $q "" -}}
{{- $scale := get (dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0) $unit -}}
{{- mulf $n $scale -}}
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

{{/* Whether the autoscaler also scales on CPU: autoscaling.cpuFallback.enabled, or by default on CPU
workers only (a GPU worker's CPU does not follow its load). "true" or "". */}}
{{- define "kvshare.cpuFallback" -}}
{{- $set := .Values.autoscaling.cpuFallback.enabled -}}
{{- if ternary (not .Values.gpu.enabled) $set (kindIs "invalid" $set) }}true{{ end -}}
{{- end -}}

{{/* The autoscaler's scale-down: every removed worker drains its streams, so not on a short lull. */}}
{{- define "kvshare.scaleDownBehavior" -}}
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDownStabilizationSeconds }}
  policies:
    - type: Pods
      value: 1
      periodSeconds: 60
{{- end -}}
