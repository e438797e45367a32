"""Render the Helm chart offline with helm-python-sdk (the Helm v4 Go SDK, no binary and
no cluster) and validate what it produces with kubernetes-validate."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "helm" / "pdserve"
EXAMPLES = ROOT / "k8s" / "examples"
KUBE_VERSION = "1.33.0"
RELEASE, NAMESPACE = "llm", "serving"
POD_IP = "10.1.2.3"  # $(POD_IP) in worker args
# Prometheus Operator CRDs: kubernetes-validate has no schema for them
CRD_KINDS = {"PodMonitor", "ServiceMonitor"}


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def load_values(name: str | None) -> dict:
    """{} for the chart defaults, else the k8s/examples/<name>.yaml values."""
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) if name else {}


def render(values: dict | None = None, *, notes: bool = False):
    """Schema-validate and render; returns the list of manifests (and NOTES.txt)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    if notes:
        return docs, next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    return docs


def lint(values: dict | None = None) -> dict:
    import helm_python as helm

    return helm.lint(
        CHART, values or {}, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )


def validate(doc: dict) -> None:
    """kubernetes-validate --strict for KUBE_VERSION; raises on an invalid manifest."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matches) == 1, f"{len(matches)} {kind} named {name}: {[kind_name(d) for d in docs]}"
    return matches[0]


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def kind_name(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def name(component: str) -> str:
    return f"{RELEASE}-pdserve-{component}"


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        assert "$(" not in arg, f"unexpanded variable in {arg!r}"
        out.append(arg)
    return out


def worker_cli(deployment: dict):
    """Parse a worker's args with pdserve's own parser, as the container would."""
    from pdserve.cli import build_parser
    from services.common.settings import WorkerSettings

    args = container(deployment)["args"]
    assert args[0] == "pdserve"
    parsed = build_parser().parse_args(expand(args[1:], {"POD_IP": POD_IP}))
    settings = {
        "transfer_protocol": parsed.transfer_protocol,
        "transfer_hostname": parsed.transfer_hostname,
        "port": parsed.port,
        "metrics_port": parsed.metrics_port,
    }
    if parsed.command == "decode":
        settings["prefill_failure_policy"] = parsed.prefill_failure_policy
    WorkerSettings(**settings)  # validates protocol, ports, policy
    return parsed


def router_cli(docs: list[dict]):
    """The router's args after Kubernetes expands $(VAR) from its ConfigMap, parsed and
    turned into a RouterConfig by the router's own code."""
    from pdserve.cli import build_parser
    from router.cli import config_from_args

    dep = find(docs, "Deployment", name("router"))
    c = container(dep)
    (ref,) = c["envFrom"]
    cm = find(docs, "ConfigMap", ref["configMapRef"]["name"])
    args = expand(c["args"], cm["data"])
    assert args[:2] == ["pdserve", "router"]
    parsed = build_parser().parse_args(args[1:])
    return parsed, config_from_args(parsed)


def resources(dep: dict) -> tuple[dict, dict]:
    res = container(dep)["resources"]
    return res.get("requests", {}), res.get("limits", {})
