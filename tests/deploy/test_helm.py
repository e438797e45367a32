"""The Helm chart (k8s/helm/pdserve), checked without helm or a cluster: lint and render
with helm-python-sdk, every manifest validated with kubernetes-validate --strict for
Kubernetes 1.33, and the fields that make a deployment work asserted for the defaults and
for each example in k8s/examples/ (cpu-demo, 1p1d-one-gpu-node, xpyd-rdma). The worker
and router command lines are parsed by the real `pdserve` argument parser."""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from tests.deploy import helm
from tests.deploy.helm import POD_IP, container, find, kinds, name, router_cli
from tests.deploy.helm import resources as _resources
from tests.deploy.helm import worker_cli as _worker_cli

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

EXAMPLES = [p.stem for p in helm.example_files()]
SHAPES = [None, *EXAMPLES]  # None: the chart defaults


def test_examples_present():
    assert {"cpu-demo", "1p1d-one-gpu-node", "xpyd-rdma", "tp-llama-70b"} <= set(EXAMPLES)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s or "defaults")
def test_lint_clean(shape):
    report = helm.lint(helm.load_values(shape))
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s or "defaults")
def test_manifests_validate_against_kubernetes(shape):
    docs = helm.render(helm.load_values(shape))
    assert docs
    for doc in docs:
        if doc["kind"] in helm.CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]["selector"]["matchLabels"]
            continue
        try:
            helm.validate(doc)
        except Exception as e:  # report which object and where
            path = "/".join(str(p) for p in getattr(e, "path", []))
            msg = getattr(e, "message", e)
            pytest.fail(f"{helm.kind_name(doc)} invalid for k8s {helm.KUBE_VERSION}: {path}: {msg}")
        assert doc["metadata"].get("namespace") in (None, helm.NAMESPACE)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s or "defaults")
def test_common_wiring(shape):
    """What every deployment shape must get right."""
    values = helm.load_values(shape)
    docs = helm.render(values)
    merged_tag = (values.get("image") or {}).get("tag") or "0.1.0"

    for role, port in (("prefill", 50061), ("decode", 50071)):
        dep = find(docs, "Deployment", name(role))
        c = container(dep)
        pod = dep["spec"]["template"]["spec"]
        # image: never latest
        assert not c["image"].endswith(":latest") and c["image"].endswith(f":{merged_tag}")
        # discovery: a headless Service selecting exactly this pool's pods
        svc = find(docs, "Service", name(role))
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"] == port
        # args understood by pdserve; the transfer hostname is the pod IP
        cli = _worker_cli(dep)
        assert cli.command == role and cli.port == port and cli.host == "0.0.0.0"
        assert cli.transfer_hostname == POD_IP
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["PDSERVE_CACHE_DIR"]["value"] == "/var/cache/pdserve"
        # the tuner's picks go to a writable mount (the root filesystem is read-only)
        tuning = env["PDSERVE_KERNEL_TUNING_DIR"]["value"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert any(tuning.startswith(m + "/") for m in mounts), (tuning, mounts)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "grpc": port,
            "metrics": cli.metrics_port,
        }
        # gRPC health probes on the gRPC port; a startup probe long enough for a load
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, probe
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 300
        assert pod["terminationGracePeriodSeconds"] > cli.drain_timeout
        # non-root
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["automountServiceAccountToken"] is False
        # PodDisruptionBudget selecting the pool
        pdb = find(docs, "PodDisruptionBudget", name(role))
        assert pdb["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]

    # router: finds the pools by their headless Service DNS names
    parsed, config = router_cli(docs)
    domain = f"{helm.NAMESPACE}.svc.cluster.local"
    assert config.prefill == (f"{name('prefill')}.{domain}:50061",)
    assert config.decode == (f"{name('decode')}.{domain}:50071",)
    router = find(docs, "Deployment", name("router"))
    c = container(router)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "checksum/config" in router["spec"]["template"]["metadata"]["annotations"]
    svc = find(docs, "Service", name("router"))
    assert svc["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_defaults():
    docs, notes = helm.render(notes=True)
    kinds_found = sorted(helm.kind_name(d) for d in docs)
    assert kinds_found == sorted(
        [
            f"ConfigMap/{name('router')}",
            f"NetworkPolicy/{name('decode')}",
            f"NetworkPolicy/{name('prefill')}",
            f"NetworkPolicy/{name('router')}",
            f"Deployment/{name('decode')}",
            f"Deployment/{name('prefill')}",
            f"Deployment/{name('router')}",
            f"PodDisruptionBudget/{name('decode')}",
            f"PodDisruptionBudget/{name('prefill')}",
            f"PodDisruptionBudget/{name('router')}",
            f"Service/{name('decode')}",
            f"Service/{name('prefill')}",
            f"Service/{name('router')}",
            "ServiceAccount/llm-pdserve",
            f"Pod/{name('test')}",
        ]
    )
    for role in ("router", "prefill", "decode"):
        assert find(docs, "Deployment", name(role))["spec"]["replicas"] == 1
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        cli = _worker_cli(dep)
        assert (cli.model, cli.device, cli.transfer_protocol) == ("smollm2-135m", "cpu", "tcp")
        requests, limits = _resources(dep)
        assert not any("gpu" in k or "rdma" in k or "hugepages" in k for k in {**limits})
        volumes = {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes == {"tmp", "home", "shm"}  # bundled model, the image's cache
    assert _worker_cli(find(docs, "Deployment", name("decode"))).prefill_failure_policy == (
        "recompute"
    )
    for role in ("prefill", "decode"):
        # kernel flags: the backend always given (auto), no choices, CUDA graphs allowed
        dep = find(docs, "Deployment", name(role))
        args = container(dep)["args"]
        assert args[args.index("--kernel-backend") + 1] == "auto"
        assert "--kernel-choices" not in args and "--enforce-eager" not in args
        cli = _worker_cli(dep)
        assert (cli.kernel_backend, cli.kernel_choices, cli.enforce_eager) == ("auto", None, False)
    parsed, config = router_cli(docs)
    assert (config.prefill_policy, config.decode_policy) == ("round_robin", "least_load")
    assert config.api_keys == ()
    # /admin is off: no token anywhere (no Secret at all, see the kinds above)
    assert config.admin_token is None
    assert "env" not in container(find(docs, "Deployment", name("router")))  # no key, no token
    assert "/admin endpoints are off" in notes
    assert find(docs, "Service", name("router"))["spec"]["type"] == "ClusterIP"
    assert f"port-forward svc/{name('router')} 8000:8000" in notes
    assert "/v1/chat/completions" in notes and "from openai import OpenAI" in notes


def test_cpu_demo():
    docs = helm.render(helm.load_values("cpu-demo"))
    assert find(docs, "Deployment", name("prefill"))["spec"]["replicas"] == 1
    assert find(docs, "Deployment", name("decode"))["spec"]["replicas"] == 2
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        cli = _worker_cli(dep)
        assert cli.device == "cpu" and cli.kv_cache_memory_gb == 0.5 and cli.max_num_seqs == 16
        assert cli.transfer_protocol == "tcp"
        requests, limits = _resources(dep)
        assert not any("gpu" in k or "rdma" in k for k in limits)
    assert not kinds(docs, "HorizontalPodAutoscaler") and not kinds(docs, "Ingress")


def test_1p1d_one_gpu_node():
    docs = helm.render(helm.load_values("1p1d-one-gpu-node"))
    nodes = set()
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        assert dep["spec"]["replicas"] == 1
        requests, limits = _resources(dep)
        assert limits["nvidia.com/gpu"] == 1 and requests["nvidia.com/gpu"] == 1
        assert not any("rdma" in k for k in limits)
        cli = _worker_cli(dep)
        assert (cli.device, cli.dtype, cli.model) == ("cuda", "bfloat16", "/models/Qwen3-8B")
        pod = dep["spec"]["template"]["spec"]
        nodes.add(pod["nodeSelector"]["kubernetes.io/hostname"])
        model = next(v for v in pod["volumes"] if v["name"] == "model")
        assert model["hostPath"]["path"] == "/data/models"
        mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == "/models" and mount["readOnly"] is True
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU
        start = container(dep)["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 1200
    assert len(nodes) == 1, "prefill and decode must land on the same node"
    assert _worker_cli(find(docs, "Deployment", name("decode"))).kv_cache_memory_gb == 60
    parsed, config = router_cli(docs)
    assert config.served_model_name == "qwen3-8b"


def test_xpyd_rdma():
    docs, notes = helm.render(helm.load_values("xpyd-rdma"), notes=True)
    prefill = find(docs, "Deployment", name("prefill"))
    decode = find(docs, "Deployment", name("decode"))
    assert prefill["spec"]["replicas"] == 2
    assert "replicas" not in decode["spec"]  # owned by the HPA
    hpa = find(docs, "HorizontalPodAutoscaler", name("decode"))
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 8)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": name("decode"),
    }
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_waiting_requests"
    for dep in (prefill, decode):
        requests, limits = _resources(dep)
        for key, value in (
            ("nvidia.com/gpu", 1),
            ("rdma/hca_shared_devices_a", 1),
            ("hugepages-1Gi", "4Gi"),
        ):
            assert limits[key] == value and requests[key] == value, key
        c = container(dep)
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert "ALL" in c["securityContext"]["capabilities"]["drop"]
        cli = _worker_cli(dep)
        assert cli.transfer_protocol == "rdma" and cli.transfer_device == "mlx5_0"
        assert cli.kv_transfer_timeout == 10 and cli.model == "/models/Llama-3.1-8B-Instruct"
        pod = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["model"]["persistentVolumeClaim"]["claimName"] == "llm-models"
        assert vols["hugepages"]["emptyDir"]["medium"] == "HugePages-1Gi"
        assert vols["model-cache"]["emptyDir"]
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert _worker_cli(decode).prefill_timeout == 30
    # monitoring: a PodMonitor per pool, a ServiceMonitor for the router
    for role in ("prefill", "decode"):
        pm = find(docs, "PodMonitor", name(role))
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    sm = find(docs, "ServiceMonitor", name("router"))
    assert sm["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    # router: API key from an existing Secret, its own image, an Ingress
    router = find(docs, "Deployment", name("router"))
    c = container(router)
    key = next(e for e in c["env"] if e["name"] == "PDSERVE_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "pdserve-api-key", "key": "api-key"}
    assert not kinds(docs, "Secret")  # the key's Secret is the user's; /admin is off
    assert c["image"] == "registry.example.com/pdserve-router:0.1.0"
    assert router["spec"]["replicas"] == 2
    parsed, config = router_cli(docs)
    assert config.prefill_policy == "prefix_aware" and config.max_concurrent_requests == 4096
    ing = find(docs, "Ingress", name("router"))
    assert ing["spec"]["rules"][0]["host"] == "llm.example.com"
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": name("router"), "port": {"name": "http"}}
    assert "https://llm.example.com" in notes and "PDSERVE_API_KEY" in notes
    assert find(docs, "PodDisruptionBudget", name("router"))["spec"]["minAvailable"] == 1


def test_nvlink_intra_sets_mooncake_variable():
    docs = helm.render({"kvTransfer": {"protocol": "nvlink_intra"}})
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", name(role)))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["MC_INTRANODE_NVLINK"] == "1"
        assert _worker_cli(find(docs, "Deployment", name(role))).transfer_protocol == (
            "nvlink_intra"
        )
    c = container(find(helm.render(), "Deployment", name("prefill")))
    assert "MC_INTRANODE_NVLINK" not in {e["name"] for e in c["env"]}


def test_kernel_flags_per_pool():
    """engine.kernelBackend / kernelChoices / enforceEager reach only their own pool."""
    choices = "paged_attention.prefill=sdpa,rms_norm=triton"
    docs = helm.render(
        {
            "prefill": {"engine": {"device": "cuda", "kernelChoices": choices}},
            "decode": {"engine": {"kernelBackend": "triton", "enforceEager": True}},
        }
    )
    prefill = find(docs, "Deployment", name("prefill"))
    decode = find(docs, "Deployment", name("decode"))
    p_args, d_args = container(prefill)["args"], container(decode)["args"]
    assert p_args[p_args.index("--kernel-choices") + 1] == choices
    assert "--enforce-eager" not in p_args
    assert "--kernel-choices" not in d_args and d_args.count("--enforce-eager") == 1
    p_cli, d_cli = _worker_cli(prefill), _worker_cli(decode)
    assert (p_cli.device, p_cli.kernel_backend, p_cli.kernel_choices) == ("cuda", "auto", choices)
    assert p_cli.enforce_eager is False
    assert (d_cli.kernel_backend, d_cli.kernel_choices, d_cli.enforce_eager) == (
        "triton",
        None,
        True,
    )
    # the tuned backend may be asked for by name, on any device
    docs = helm.render({"decode": {"engine": {"kernelBackend": "tuned", "kernelChoices": choices}}})
    d_cli = _worker_cli(find(docs, "Deployment", name("decode")))
    assert (d_cli.device, d_cli.kernel_backend, d_cli.kernel_choices) == ("cpu", "tuned", choices)


def test_kv_cache_dtype_reaches_both_pools():
    """engine.kvCacheDtype becomes --kv-cache-dtype (default auto); both pools are set
    alike, since the handshake refuses a prefill / decode pair whose KV dtypes differ."""
    for role in ("prefill", "decode"):
        assert _worker_cli(find(helm.render(), "Deployment", name(role))).kv_cache_dtype == "auto"
    fp8 = {"engine": {"kvCacheDtype": "fp8"}}
    docs = helm.render({"prefill": fp8, "decode": fp8})
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        args = container(dep)["args"]
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
        assert _worker_cli(dep).kv_cache_dtype == "fp8"


def test_api_key_value_admin_secret_and_amd_gpus():
    docs = helm.render(
        {
            "router": {
                "apiKey": {"value": "s3cret"},
                "adminToken": {"existingSecret": "ops", "secretKey": "token"},
            },
            "decode": {"gpu": {"count": 2, "resource": "amd.com/gpu"}},
        }
    )
    secret = find(docs, "Secret", name("router"))
    assert set(secret["data"]) == {"api-key"}
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret"
    env = {e["name"]: e for e in container(find(docs, "Deployment", name("router")))["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": name("router"),
        "key": "api-key",
    }
    assert env["PDSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "ops",
        "key": "token",
    }
    # generate: a random 32-character token in the chart's Secret, given to the router
    docs_gen, notes = helm.render({"router": {"adminToken": {"generate": True}}}, notes=True)
    secret = find(docs_gen, "Secret", name("router"))
    assert set(secret["data"]) == {"admin-token"}
    assert len(base64.b64decode(secret["data"]["admin-token"])) == 32
    env_gen = {e["name"]: e for e in container(find(docs_gen, "Deployment", name("router")))["env"]}
    assert env_gen["PDSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": name("router"),
        "key": "admin-token",
    }
    assert "The token of the router's /admin endpoints" in notes
    requests, limits = _resources(find(docs, "Deployment", name("decode")))
    assert limits["amd.com/gpu"] == 2


def test_prefill_and_decode_are_twins():
    """One helper renders both pools: their Deployments differ only by role, port and the
    decode-only flags; their values sections have the same keys and one schema definition
    validates both."""
    docs = helm.render()
    p, d = (find(docs, "Deployment", name(r)) for r in ("prefill", "decode"))
    decode_only = ["--prefill-timeout", "--prefill-failure-policy", "--reserve-timeout"]
    d_args = container(d)["args"]
    for flag in decode_only:
        i = d_args.index(flag)
        d_args = d_args[:i] + d_args[i + 2 :]
    container(d)["args"] = d_args
    as_prefill = json.dumps(d).replace("decode", "prefill").replace("50071", "50061")
    assert json.loads(as_prefill) == p
    templates = {
        t: (helm.CHART / "templates" / f"{t}.yaml").read_text() for t in ("prefill", "decode")
    }
    for role, text in templates.items():
        assert f'include "pdserve.worker" (dict "root" . "role" "{role}")' in text

    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())
    extras = {"prefillFailurePolicy", "prefillTimeout", "reserveTimeout"}
    assert set(values["decode"]) - set(values["prefill"]) == extras
    assert set(values["prefill"]) == set(values["decode"]) - extras
    schema = json.loads((helm.CHART / "values.schema.json").read_text())
    pool = schema["definitions"]["workerPool"]
    assert set(pool["properties"]) == set(values["decode"])
    assert pool["additionalProperties"] is False
    prefill, decode = (schema["properties"][r] for r in ("prefill", "decode"))
    for section in (prefill, decode):
        assert section["allOf"] == [{"$ref": "#/definitions/workerPool"}]
        assert set(section) <= {"description", "allOf", "properties", "required"}
    # the role differences: prefill refuses the decode-only keys, decode requires them
    # and at least one replica
    assert prefill["properties"] == dict.fromkeys(extras, False)
    assert "required" not in prefill
    assert set(decode["required"]) == extras
    assert set(decode["properties"]) == {"replicas"}
    assert decode["properties"]["replicas"]["minimum"] == 1
