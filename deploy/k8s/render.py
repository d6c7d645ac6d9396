#!/usr/bin/env python3
"""render.py - Kubernetes manifests for N moerpc expert servers, sized from the model.

    deploy/k8s/render.py --config /models/qwen3-30b-a3b/config.json --servers 4 \
        --image registry.example/moerpc:1.1 --model-path /models/qwen3-30b-a3b \
        [--format bf16|int8|int4|fp8] [--replicas 1|2] [--namespace moerpc] \
        [--serve [--serve-replicas N --serve-cpus C --serve-memory-gib G]] > moerpc.yaml

Writes one multi-document YAML (JSON is YAML, so no YAML library is needed):
  ConfigMap   moerpc-config: cluster.json for clients, and the --experts of each ordinal
  Service     moerpc-servers: headless, stable DNS moerpc-server-<i>.moerpc-servers.<ns>
  StatefulSet moerpc-server: one pod per expert share, probes on the metrics port
  PodDisruptionBudget: at most one server down at a time (with --replicas 2: no expert lost)
With --serve, also the OpenAI-compatible front (moerpc-client serve) using that cluster:
  Deployment  moerpc-serve: --serve-replicas pods, readiness on GET /health (200 only once
              the model and the cluster are up, 503 while draining), liveness on /healthz
  Service     moerpc-serve: port 8000 (/v1/chat/completions, /v1/completions, /metrics)
  Its API key is the secret moerpc-api-key (key "key"), mounted as a file.
Memory requests = the packed expert weights of one share (from config.json: layers x
experts x 3 x hidden x intermediate x bytes per weight of --format) + the admission budget
(--max-inflight-bytes) + 1 GiB of process overhead. Only the standard library is used.
docs/deploy.md walks through it.
"""
import argparse
import json
import math
import sys

BYTES_PER_WEIGHT = {"bf16": 2.0, "f16": 2.0, "f32": 4.0, "int8": 1.0 + 4.0 / 1024, "int4": 0.5 + 4.0 / 64,
                    "fp8": 1.0 + 4.0 / 128}  # fp8-b128: e4m3 + one fp32 per row and 128-block
GRPC_PORT = 50051
SERVE_PORT = 8000
SERVE_DRAIN_S = 30
METRICS_PORT = 9464
GIB = 1 << 30
# The pods run as 10001:10001. Secret files (TLS key, bearer token, API key) are owned by
# root; the server and the client refuse a secret that group or others may read, unless root
# owns it and the group may only read it (docs/DESIGN.md section 11). So the secret volumes
# are 0440 and fsGroup makes their group the pods' own; OnRootMismatch keeps the kubelet
# from re-owning the whole (large) model volume on every start.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                "fsGroupChangePolicy": "OnRootMismatch"}
SECRET_MODE = 0o440

# The read-only mounts of both containers: models, the cluster file, TLS files, the token.
COMMON_MOUNTS = [{"name": n, "mountPath": m, "readOnly": True} for n, m in (
    ("models", "/models"), ("config", "/etc/moerpc/config"), ("tls", "/etc/moerpc/tls"),
    ("token", "/etc/moerpc/token"))]


def probes_and_limits(port, ready_path, resources):
    """Probes, resources and the security context of a container. Loading hundreds of GB
    takes minutes: the startup probe allows an hour of it before liveness applies; readiness
    (ready_path) is 503 while loading and from SIGTERM on, so the pod leaves the Service's
    endpoints before its drain."""
    return {
        "startupProbe": {"httpGet": {"path": "/healthz", "port": port},
                         "periodSeconds": 10, "failureThreshold": 360},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": port},
                          "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": ready_path, "port": port},
                           "periodSeconds": 5, "failureThreshold": 1},
        "resources": {"requests": resources, "limits": resources},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }


def fail(msg):
    print(f"render.py: {msg}", file=sys.stderr)
    sys.exit(2)


def model_dims(path):
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"--config {path}: {e}")
    c = c.get("text_config", c)
    try:
        H = int(c["hidden_size"])
        I = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        E = int(c.get("num_experts") or c.get("n_routed_experts") or c["num_local_experts"])
        L = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        fail(f"--config {path}: missing or bad field {e}")
    dense = int(c.get("first_k_dense_replace", 0) or 0)
    step = int(c.get("decoder_sparse_step", 1) or 1)
    moe_layers = sum(1 for l in range(L) if l >= dense and (l + 1) % step == 0)
    return H, I, E, moe_layers


def shares(E, n, replicas):
    """Expert ranges of n servers; with replicas 2 each range is also served by the next."""
    base = [(i * E // n, (i + 1) * E // n - 1) for i in range(n)]
    out = []
    for i in range(n):
        ranges = [base[i]]
        if replicas == 2:
            ranges.append(base[(i + 1) % n])
        out.append(",".join(f"{a}-{b}" for a, b in ranges))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the model's config.json")
    ap.add_argument("--servers", type=int, required=True, help="expert servers, 1..1024")
    ap.add_argument("--image", required=True, help="container image holding /usr/local/bin/moerpc-server")
    ap.add_argument("--model-path", required=True, help="the model directory inside the pods")
    ap.add_argument("--models-pvc", default="moerpc-models", help="PersistentVolumeClaim holding the models")
    ap.add_argument("--format", default="bf16", choices=sorted(BYTES_PER_WEIGHT))
    ap.add_argument("--replicas", type=int, default=1, choices=[1, 2], help="servers per expert")
    ap.add_argument("--budget-gib", type=float, default=2.0, help="--max-inflight-bytes, GiB")
    ap.add_argument("--cpus", type=int, default=16, help="CPU request and limit per server")
    ap.add_argument("--namespace", default="moerpc")
    ap.add_argument("--deadline-ms", type=int, default=5000)
    ap.add_argument("--metrics-token", action="store_true",
                    help="/metrics requires the bearer token of the secret moerpc-metrics-token (key "
                         "\"token\"); give Prometheus the same token")
    ap.add_argument("--serve", action="store_true", help="also the moerpc-client serve Deployment and Service")
    ap.add_argument("--serve-replicas", type=int, default=1, help="serve pods, 1..64")
    ap.add_argument("--serve-cpus", type=int, default=8, help="CPU request and limit per serve pod")
    ap.add_argument("--serve-memory-gib", type=int, default=16,
                    help="memory per serve pod: dense weights, hot experts, KV cache")
    ap.add_argument("--serve-max-batch", type=int, default=16, help="serve --max-batch")
    a = ap.parse_args()
    if not 1 <= a.serve_replicas <= 64:
        fail(f"--serve-replicas {a.serve_replicas}: must be in 1..64")
    if not 1 <= a.serve_cpus <= 1024 or not 1 <= a.serve_memory_gib <= 65536:
        fail("--serve-cpus must be in 1..1024 and --serve-memory-gib in 1..65536")
    if not 1 <= a.servers <= 1024:
        fail(f"--servers {a.servers}: must be in 1..1024")
    if a.replicas == 2 and a.servers < 2:
        fail("--replicas 2 needs --servers >= 2")
    if not 0.25 <= a.budget_gib <= 1024:
        fail(f"--budget-gib {a.budget_gib}: must be in 0.25..1024")
    H, I, E, moe_layers = model_dims(a.config)
    if a.servers > E:
        fail(f"--servers {a.servers}: more servers than the model's {E} experts")

    per_expert = 3 * H * I * BYTES_PER_WEIGHT[a.format]
    experts_per_server = math.ceil(E / a.servers) * a.replicas
    weights = per_expert * experts_per_server * moe_layers
    mem_gib = math.ceil((weights + a.budget_gib * GIB + GIB) / GIB)
    ns = a.namespace
    svc = "moerpc-servers"
    experts = shares(E, a.servers, a.replicas)

    cluster = {
        "deadline_ms": a.deadline_ms,
        "servers": [{"name": f"s{i}", "address": f"moerpc-server-{i}.{svc}.{ns}.svc:{GRPC_PORT}"}
                    for i in range(a.servers)],
        "tls": {"ca": "/etc/moerpc/tls/ca.crt", "server_name": f"{svc}.{ns}.svc"},
        "token_file": "/etc/moerpc/token/token",
    }
    labels = {"app.kubernetes.io/name": "moerpc-server", "app.kubernetes.io/part-of": "moerpc"}
    docs = []
    docs.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "moerpc-config", "namespace": ns, "labels": labels},
        "data": dict({"cluster.json": json.dumps(cluster, indent=2) + "\n"},
                     **{f"experts-{i}": experts[i] for i in range(a.servers)}),
    })
    docs.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": svc, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": labels,
                 "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]},
    })
    flags = (f"--model {a.model_path} --experts \"$(cat /etc/moerpc/config/experts-$POD_INDEX)\" "
             f"--listen 0.0.0.0:{GRPC_PORT} --metrics-listen 0.0.0.0:{METRICS_PORT} "
             f"--tls-cert /etc/moerpc/tls/tls.crt --tls-key /etc/moerpc/tls/tls.key "
             f"--auth-token-file /etc/moerpc/token/token "
             f"--max-inflight-bytes {int(a.budget_gib * GIB)} --threads {a.cpus} "
             f"--drain-timeout-ms 20000")
    if a.format != "bf16":
        flags += f" --quant {a.format}"
    # The metrics port is on the pod network (kubelet probes it, Prometheus scrapes it): it
    # shows the model fingerprint and the load; --metrics-token puts /metrics behind a token
    # (the probes stay open).
    if a.metrics_token:
        flags += " --metrics-token-file /etc/moerpc/metrics-token/token"
    resources = {"cpu": str(a.cpus), "memory": f"{mem_gib}Gi"}
    docs.append({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "moerpc-server", "namespace": ns, "labels": labels},
        "spec": {
            "serviceName": svc,
            "replicas": a.servers,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(METRICS_PORT)}},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": POD_SECURITY,
                    "containers": [{
                        "name": "moerpc-server",
                        "image": a.image,
                        "command": ["/bin/sh", "-c", f"exec /usr/local/bin/moerpc-server {flags}"],
                        "env": [{"name": "POD_INDEX", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
                                {"name": "MOERPC_LOG", "value": "info"}],
                        "ports": [{"name": "grpc", "containerPort": GRPC_PORT},
                                  {"name": "metrics", "containerPort": METRICS_PORT}],
                        # Probes on the plain-HTTP metrics port: kubelet's gRPC probe cannot
                        # speak TLS. Loading hundreds of GB takes minutes: the startup probe
                        # allows an hour before liveness applies.
                        **probes_and_limits("metrics", "/readyz", resources),
                        "volumeMounts": [
                            *COMMON_MOUNTS,
                        ] + ([{"name": "metrics-token", "mountPath": "/etc/moerpc/metrics-token",
                               "readOnly": True}] if a.metrics_token else []),
                    }],
                    "volumes": [
                        {"name": "models", "persistentVolumeClaim": {"claimName": a.models_pvc,
                                                                     "readOnly": True}},
                        {"name": "config", "configMap": {"name": "moerpc-config"}},
                        {"name": "tls", "secret": {"secretName": "moerpc-server-tls",
                                                   "defaultMode": SECRET_MODE}},
                        {"name": "token", "secret": {"secretName": "moerpc-token",
                                                     "defaultMode": SECRET_MODE}},
                    ] + ([{"name": "metrics-token", "secret": {"secretName": "moerpc-metrics-token",
                                                               "defaultMode": SECRET_MODE}}]
                         if a.metrics_token else []),
                },
            },
        },
    })
    docs.append({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "moerpc-server", "namespace": ns, "labels": labels},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    })
    if a.serve:
        docs.extend(serve_docs(a, ns))
    sys.stdout.write(f"# moerpc: {a.servers} expert servers for a model of {moe_layers} MoE layers x "
                     f"{E} experts (H {H}, I {I}), {a.format}, {a.replicas} replica(s) per expert\n"
                     f"# per server: {weights / GIB:.2f} GiB of weights + {a.budget_gib:g} GiB "
                     f"budget + 1 GiB overhead -> {mem_gib}Gi\n"
                     f"# generated by deploy/k8s/render.py; secrets moerpc-server-tls and "
                     f"moerpc-token and the PVC {a.models_pvc} are the operator's\n")
    for d in docs:
        sys.stdout.write("---\n" + json.dumps(d, indent=2) + "\n")


def serve_docs(a, ns):
    """The Deployment and Service of moerpc-client serve (the client process: attention,
    hot experts, the OpenAI-compatible API) on the cluster of the ConfigMap."""
    labels = {"app.kubernetes.io/name": "moerpc-serve", "app.kubernetes.io/part-of": "moerpc"}
    flags = (f"--model {a.model_path} --cluster /etc/moerpc/config/cluster.json "
             f"--listen 0.0.0.0:{SERVE_PORT} --api-key-file /etc/moerpc/api-key/key "
             f"--max-batch {a.serve_max_batch} --threads {a.serve_cpus} --drain-timeout {SERVE_DRAIN_S}")
    resources = {"cpu": str(a.serve_cpus), "memory": f"{a.serve_memory_gib}Gi"}
    deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "moerpc-serve", "namespace": ns, "labels": labels},
        "spec": {
            "replicas": a.serve_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(SERVE_PORT)}},
                "spec": {
                    # the drain (--drain-timeout) plus the time to send the last answers
                    "terminationGracePeriodSeconds": SERVE_DRAIN_S + 15,
                    "securityContext": POD_SECURITY,
                    "containers": [{
                        "name": "moerpc-serve",
                        "image": a.image,
                        "command": ["/bin/sh", "-c", f"exec /usr/local/bin/moerpc-client serve {flags}"],
                        "env": [{"name": "MOERPC_LOG", "value": "info"}],
                        "ports": [{"name": "http", "containerPort": SERVE_PORT}],
                        # /health is 503 while the model loads and from SIGTERM on: the pod
                        # leaves the Service's endpoints before its drain, and joins them
                        # only once it can answer. The startup probe allows an hour of load.
                        **probes_and_limits("http", "/health", resources),
                        "volumeMounts": [
                            *COMMON_MOUNTS,
                            {"name": "api-key", "mountPath": "/etc/moerpc/api-key", "readOnly": True},
                        ],
                    }],
                    "volumes": [
                        {"name": "models", "persistentVolumeClaim": {"claimName": a.models_pvc,
                                                                     "readOnly": True}},
                        {"name": "config", "configMap": {"name": "moerpc-config"}},
                        {"name": "tls", "secret": {"secretName": "moerpc-server-tls",
                                                   "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"name": "token", "secret": {"secretName": "moerpc-token",
                                                     "defaultMode": SECRET_MODE}},
                        {"name": "api-key", "secret": {"secretName": "moerpc-api-key",
                                                       "defaultMode": SECRET_MODE}},
                    ],
                },
            },
        },
    }
    svc = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "moerpc-serve", "namespace": ns, "labels": labels},
        "spec": {"selector": labels,
                 "ports": [{"name": "http", "port": SERVE_PORT, "targetPort": "http"}]},
    }
    return [deploy, svc]


if __name__ == "__main__":
    main()
