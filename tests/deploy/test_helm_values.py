"""The Helm chart's values (k8s/helm/pdserve): every value documented, bad values
refused by the schema or the templates before anything is deployed, and single values
reaching the command lines and volumes they are for. Rendered without helm or a
cluster, as tests/deploy/test_helm.py does; command lines parsed by pdserve's own
parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy import helm
from tests.deploy.helm import container, find, kinds, name, router_cli

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

BAD_VALUES = Path(__file__).parent / "bad-values.yaml"


def test_every_value_is_documented():
    schema = json.loads((helm.CHART / "values.schema.json").read_text())
    undocumented = []

    def walk(node: dict | bool, path: str) -> None:
        if isinstance(node, bool):  # false: a key refused there (decode-only in prefill)
            return
        for key, sub in (node.get("properties") or {}).items():
            if isinstance(sub, dict) and not sub.get("description"):
                undocumented.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    for key, definition in schema["definitions"].items():  # what the $refs point to
        walk(definition, f"#/definitions/{key}")
    assert undocumented == []
    # and every default value is covered by the schema (additionalProperties: false)
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])


BAD = [
    ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
    ({"decode": {"replicas": 0}}, "/decode/replicas"),
    ({"kvTransfer": {"protocol": "udp"}}, "/kvTransfer/protocol"),
    ({"prefil": {"replicas": 1}}, "prefil"),
    ({"decode": {"prefillFailurePolicy": "retry"}}, "/decode/prefillFailurePolicy"),
    ({"prefill": {"prefillTimeout": 5}}, "prefillTimeout"),  # decode-only key
    ({"router": {"policy": {"prefill": "random"}}}, "/router/policy/prefill"),
    ({"router": {"toolCallParser": "pythonic"}}, "/router/toolCallParser"),
    ({"prefill": {"gpu": {"count": -1}}}, "/prefill/gpu/count"),
    ({"prefill": {"hugepages": {"size": "4Mi"}}}, "/prefill/hugepages/size"),
    ({"model": {"source": "pvc"}}, "claimName"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"model": {"pvc": {"subPath": "/abs"}}}, "/model/pvc/subPath"),
    ({"model": {"pvc": {"subPath": "a/../b"}}}, "/model/pvc/subPath': 'not' failed"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"prefill": {"engine": {"kernelBackend": "cudnn"}}}, "/prefill/engine/kernelBackend"),
    ({"decode": {"engine": {"enforceEager": "yes"}}}, "/decode/engine/enforceEager"),
    ({"prefill": {"engine": {"kvCacheDtype": "fp8_e5m2"}}}, "/prefill/engine/kvCacheDtype"),
    (
        {"decode": {"engine": {"kernelBackend": "tuned", "kernelChoices": "rms_norm=triton;id"}}},
        "/decode/engine/kernelChoices",
    ),
    # kernel choices only apply to the tuned backend (tuned, or auto on a GPU)
    (
        {"prefill": {"engine": {"kernelBackend": "torch", "kernelChoices": "rms_norm=triton"}}},
        "/prefill/engine': 'anyOf' failed",
    ),
    ({"decode": {"engine": {"kernelChoices": "rms_norm=triton"}}}, "/decode/engine': 'anyOf'"),
]


@pytest.mark.parametrize("values,where", BAD, ids=[w for _, w in BAD])
def test_bad_values_rejected(values, where):
    import helm_python

    with pytest.raises(helm_python.HelmValuesError) as err:
        helm.render(values)
    assert where in str(err.value)


def test_bad_values_file_fails_early():
    """The checked-in bad values file: schema validation, lint and install-render fail."""
    import helm_python

    values = yaml.safe_load(BAD_VALUES.read_text())
    with helm_python.Chart.load(helm.CHART) as chart:
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(values)
        with pytest.raises(helm_python.HelmValuesError):
            chart.render(values, name=helm.RELEASE, namespace=helm.NAMESPACE, is_install=True)
    report = helm.lint(values)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


def test_no_prefill_pool_runs_the_router_colocated():
    """prefill.replicas 0: the router gets no prefill address (a headless Service with
    no pods would leave it waiting for pairs forever) and runs colocated."""
    docs = helm.render({"prefill": {"replicas": 0}})
    assert find(docs, "Deployment", name("prefill"))["spec"]["replicas"] == 0
    parsed, config = router_cli(docs)
    assert config.prefill == () and len(config.decode) == 1
    from router.registry import WorkerRegistry

    assert WorkerRegistry(config).colocated
    # autoscaled prefill pools keep their address whatever replicas says
    docs = helm.render({"prefill": {"replicas": 0, "autoscaling": {"enabled": True}}})
    assert len(router_cli(docs)[1].prefill) == 1


def test_tool_call_parser_enables_auto_tool_choice():
    """router.toolCallParser passes vLLM's two tool flags; unset, neither."""
    config = router_cli(helm.render())[1]
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == (None, False)
    config = router_cli(helm.render({"router": {"toolCallParser": "hermes"}}))[1]
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", True)


def test_api_server_count_reaches_the_router():
    """router.apiServerCount is --api-server-count (default 1); with an admin token it is
    refused at render time, as the router would refuse it at start."""
    import helm_python

    assert router_cli(helm.render())[1].api_server_count == 1
    assert router_cli(helm.render({"router": {"apiServerCount": 4}}))[1].api_server_count == 4
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmError)) as err:
        helm.render({"router": {"apiServerCount": 2, "adminToken": {"generate": True}}})
    assert "leave router.adminToken unset" in str(err.value)
    with pytest.raises(helm_python.HelmValuesError) as err:
        helm.render({"router": {"apiServerCount": 0}})
    assert "/router/apiServerCount" in str(err.value)


@pytest.mark.parametrize("cache_type", ["image", "emptyDir", "pvc"])
def test_triton_kernels_cached_on_the_model_cache_volume(cache_type):
    """A writable model cache (emptyDir, pvc) also keeps the compiled Triton kernels, so
    a pvc shares them between pods; the image's read-only copy leaves Triton's default."""
    cache = {"type": cache_type, "path": "/cache"}
    if cache_type == "pvc":
        cache["claimName"] = "models"
    docs = helm.render({"model": {"cache": cache}})
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", name(role)))
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        if cache_type == "image":
            assert "TRITON_CACHE_DIR" not in env
        else:
            assert env["TRITON_CACHE_DIR"] == "/cache/triton" and "/cache" in mounts


@pytest.mark.parametrize("sub_path", ["", "Llama-3.1-8B-Instruct"], ids=["no-subPath", "subPath"])
def test_model_pvc_sub_path_is_mounted(sub_path):
    """model.pvc.subPath: the workers mount only that folder of the claim at mountPath."""
    model = {"name": "/models", "source": "pvc", "pvc": {"claimName": "llm-models"}}
    if sub_path:
        model["pvc"]["subPath"] = sub_path
    values = {"model": model}
    assert helm.lint(values)["errors"] == []
    docs = helm.render(values)
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        helm.validate(dep)
        (volume,) = (v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "llm-models", "readOnly": True}
        (mount,) = (m for m in container(dep)["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == "/models" and mount["readOnly"] is True
        if sub_path:
            assert mount["subPath"] == sub_path
        else:
            assert "subPath" not in mount
    # the router and the helm test pod do not mount the model
    for doc in docs:
        if doc["kind"] in ("Deployment", "Pod") and doc["metadata"]["name"] not in (
            name("prefill"),
            name("decode"),
        ):
            pod = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
            assert all(v["name"] != "model" for v in pod.get("volumes", []))


def test_model_pvc_sub_path_ignored_for_host_path():
    docs = helm.render(
        {
            "model": {
                "source": "hostPath",
                "hostPath": {"path": "/data/models"},
                "pvc": {"subPath": "Llama-3.1-8B-Instruct"},
            }
        }
    )
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", name(role)))
        (mount,) = (m for m in c["volumeMounts"] if m["name"] == "model")
        assert "subPath" not in mount


def test_grafana_dashboard_configmap():
    """Off by default; on, a ConfigMap with the sidecar's label holds the dashboard JSON,
    whose queries use the metric names the router and workers export."""
    assert not any(
        d["metadata"]["name"] == name("dashboard") for d in kinds(helm.render(), "ConfigMap")
    )
    values = {
        "monitoring": {
            "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}
        }
    }
    docs = helm.render(values)
    cm = find(docs, "ConfigMap", name("dashboard"))
    helm.validate(cm)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dashboard = json.loads(cm["data"]["pdserve-pd.json"])
    assert dashboard["uid"] == "pdserve-pd"
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "vllm:time_to_first_token_seconds",
        "vllm:kv_cache_usage_perc",
        "pdserve_router_prefill_time_seconds",
        "pdserve_router_kv_transfer_time_seconds",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_prefill_fallbacks_total",
        "pdserve_router_worker_num_free_blocks",
        "pdserve_merged_responses_total",
    ):
        assert metric in exprs, metric
    # a label the sidecar does not know cannot be a number
    import helm_python

    with pytest.raises(helm_python.HelmValuesError):
        helm.render({"monitoring": {"grafanaDashboard": {"enabled": True, "labels": {"a": 1}}}})


def test_model_from_the_hugging_face_hub():
    """model.source hub: no model volume; each worker gets the Hub id, --revision, the
    Hugging Face cache on the model cache volume (HF_HOME) and the token from a Secret."""
    values = {
        "model": {
            "name": "Qwen/Qwen2.5-7B-Instruct",
            "source": "hub",
            "hub": {"revision": "v1.1", "tokenSecret": "hf-token"},
            "cache": {"type": "pvc", "claimName": "model-cache", "path": "/cache"},
        }
    }
    assert helm.lint(values)["errors"] == []
    docs = helm.render(values)
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        helm.validate(dep)
        c = container(dep)
        args = c["args"]
        assert args[args.index("--model") + 1] == "Qwen/Qwen2.5-7B-Instruct"
        assert args[args.index("--revision") + 1] == "v1.1"
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_HOME"]["value"] == "/cache/huggingface"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "hf-token",
            "key": "HF_TOKEN",
        }
        assert "/cache" in {m["mountPath"] for m in c["volumeMounts"]}
        pod = dep["spec"]["template"]["spec"]
        assert all(v["name"] != "model" for v in pod["volumes"])
    # no token, no revision: neither appears
    values["model"]["hub"] = {}
    c = container(find(helm.render(values), "Deployment", name("decode")))
    assert "--revision" not in c["args"]
    assert "HF_TOKEN" not in {e["name"] for e in c["env"]}


@pytest.mark.parametrize(
    "model, message",
    [
        (
            {"source": "hub", "name": "Qwen/Qwen2.5-7B-Instruct"},
            "set model.cache.type to emptyDir or pvc",
        ),
        ({"source": "bundled", "hub": {"revision": "v1"}}, "apply to model.source hub"),
        (
            {"source": "hostPath", "hostPath": {"path": "/m"}, "hub": {"tokenSecret": "t"}},
            "apply to model.source hub",
        ),
    ],
)
def test_hub_values_that_cannot_apply_are_refused(model, message):
    import helm_python

    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmError)) as err:
        helm.render({"model": model})
    assert message in str(err.value)
