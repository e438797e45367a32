"""The chart's NetworkPolicies, rendered offline and evaluated: a small model of
Kubernetes' ingress rules (pod and namespace selectors, ports and port ranges) decides
who may reach which port of which pod, and the tests check the whole matrix: the router
is the only pod anyone may reach, worker gRPC only from the router (and decode ->
prefill), Mooncake's port range only between workers, metrics only from the configured
Prometheus peers."""

from __future__ import annotations

import pytest

from tests.deploy import helm
from tests.deploy.helm import container, find, kinds, name

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

NS = {"kubernetes.io/metadata.name": helm.NAMESPACE}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"namespaceSelector": {"matchLabels": MONITORING}}
MOONCAKE = (15000, 16500, 17000)  # the default range's ends and a port inside it


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, pod: dict, ns: dict) -> bool:
    if "ipBlock" in peer:
        return False  # pods are identified by labels here, not addresses
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], ns):
            return False
    elif ns != NS:  # a bare podSelector means the policy's own namespace
        return False
    return _selects(peer.get("podSelector") or {}, pod)


def _port_admits(ports, port: int) -> bool:
    if not ports:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)


def admits(docs: list[dict], target: dict, pod: dict, port: int, ns: dict = NS) -> bool:
    """Whether a pod labelled `pod` in a namespace labelled `ns` may open `port` on a pod
    labelled `target`, under the rendered policies (none selecting it: open)."""
    policies = [
        p for p in kinds(docs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], target)
    ]
    if not policies:
        return True
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress") or []:
            if _port_admits(rule.get("ports"), port) and (
                not rule.get("from") or any(_peer_admits(p, pod, ns) for p in rule["from"])
            ):
                return True
    return False


def _labels(docs: list[dict]) -> dict[str, dict]:
    """Pod labels of every component, as rendered, plus a stranger in the namespace."""
    out = {
        role: find(docs, "Deployment", name(role))["spec"]["template"]["metadata"]["labels"]
        for role in ("router", "prefill", "decode")
    }
    out["test"] = find(docs, "Pod", name("test"))["metadata"]["labels"]
    out["stranger"] = {"app": "curious"}
    return out


def _ports(docs: list[dict], role: str) -> dict[str, int]:
    c = container(find(docs, "Deployment", name(role)))
    return {p["name"]: p["containerPort"] for p in c["ports"]}


@pytest.mark.parametrize("shape", [None, *[p.stem for p in helm.example_files()]])
def test_who_reaches_what(shape):
    """The full matrix for the defaults and every example (xpyd-rdma lets Prometheus
    in the monitoring namespace scrape the workers)."""
    values = helm.load_values(shape)
    docs = helm.render(values)
    pods = _labels(docs)
    scraped = bool(values.get("networkPolicy", {}).get("metrics", {}).get("from"))
    assert scraped == (shape == "xpyd-rdma")
    router_port = _ports(docs, "router")["http"]
    # the router: anyone, in any namespace, on its HTTP port only
    for src in pods.values():
        assert admits(docs, pods["router"], src, router_port)
        assert admits(docs, pods["router"], src, router_port, ns=MONITORING)
        assert not admits(docs, pods["router"], src, router_port + 1)
    grpc_callers = {"prefill": {"router", "decode"}, "decode": {"router"}}
    for role in ("prefill", "decode"):
        ports = _ports(docs, role)
        for src, labels in pods.items():
            assert admits(docs, pods[role], labels, ports["grpc"]) == (src in grpc_callers[role])
            for port in MOONCAKE:
                assert admits(docs, pods[role], labels, port) == (src in ("prefill", "decode"))
            assert not admits(docs, pods[role], labels, ports["metrics"])  # metrics.from empty
            assert not admits(docs, pods[role], labels, 14999)
            assert not admits(docs, pods[role], labels, 17001)
        # from other namespaces: nothing but Prometheus' scrapes, where configured
        for labels in pods.values():
            assert admits(docs, pods[role], labels, ports["metrics"], ns=MONITORING) == scraped
            for port in (ports["grpc"], *MOONCAKE):
                assert not admits(docs, pods[role], labels, port, ns=MONITORING)


def test_every_pod_is_covered_and_workers_get_the_port_range():
    docs = helm.render({"kvTransfer": {"portRange": {"min": 20000, "max": 20100}}})
    policies = kinds(docs, "NetworkPolicy")
    for role in ("router", "prefill", "decode"):
        dep = find(docs, "Deployment", name(role))
        labels = dep["spec"]["template"]["metadata"]["labels"]
        (policy,) = [p for p in policies if helm.kind_name(p) == f"NetworkPolicy/{name(role)}"]
        assert (
            policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        )
        assert _selects(policy["spec"]["podSelector"], labels)
    pods = _labels(docs)
    for role in ("prefill", "decode"):
        env = {
            e["name"]: e.get("value")
            for e in container(find(docs, "Deployment", name(role)))["env"]
        }
        # Mooncake picks its listen ports from exactly the range the policy opens
        assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("20000", "20100")
        assert admits(docs, pods[role], pods["decode"], 20050)
        assert not admits(docs, pods[role], pods["decode"], 15000)


def test_metrics_peers_and_a_restricted_router():
    ingress_ns = {"kubernetes.io/metadata.name": "ingress-nginx"}
    values = {
        "networkPolicy": {
            "router": {"from": [{"namespaceSelector": {"matchLabels": ingress_ns}}]},
            "metrics": {"from": [PROMETHEUS]},
        }
    }
    docs = helm.render(values)
    pods = _labels(docs)
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for role in ("prefill", "decode"):
        ports = _ports(docs, role)
        assert admits(docs, pods[role], prometheus, ports["metrics"], ns=MONITORING)
        assert not admits(docs, pods[role], prometheus, ports["grpc"], ns=MONITORING)
        assert not admits(docs, pods[role], pods["router"], ports["metrics"])
    port = _ports(docs, "router")["http"]
    assert admits(docs, pods["router"], {"app": "nginx"}, port, ns=ingress_ns)
    assert admits(docs, pods["router"], prometheus, port, ns=MONITORING)  # router /metrics
    assert admits(docs, pods["router"], pods["test"], port)  # `helm test`
    assert not admits(docs, pods["router"], pods["stranger"], port)
    assert not admits(docs, pods["router"], pods["decode"], port)


def test_extra_worker_rules_and_off_switch():
    kubelet = {"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}], "ports": [{"port": 50061}]}
    docs = helm.render({"networkPolicy": {"workerExtraIngress": [kubelet]}})
    for role in ("prefill", "decode"):
        assert kinds(docs, "NetworkPolicy")  # rendered, and valid for Kubernetes:
        helm.validate(find(docs, "NetworkPolicy", name(role)))
        assert find(docs, "NetworkPolicy", name(role))["spec"]["ingress"][-1] == kubelet
    docs, notes = helm.render({"networkPolicy": {"enabled": False}}, notes=True)
    assert not kinds(docs, "NetworkPolicy") and "NetworkPolicies:" not in notes
    for role in ("prefill", "decode"):  # the port range still reaches Mooncake
        env = {e["name"] for e in container(find(docs, "Deployment", name(role)))["env"]}
        assert {"MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"} <= env


def test_notes_warn_when_prometheus_cannot_scrape():
    _, notes = helm.render({"monitoring": {"podMonitor": {"enabled": True}}}, notes=True)
    assert "networkPolicy.metrics.from is empty" in notes
    values = {"monitoring": {"podMonitor": {"enabled": True}}}
    values["networkPolicy"] = {"metrics": {"from": [PROMETHEUS]}}
    assert "metrics.from is empty" not in helm.render(values, notes=True)[1]


@pytest.mark.parametrize(
    "values,where",
    [
        ({"networkPolicy": {"router": {"from": [{"pods": {}}]}}}, "/networkPolicy/router/from/0"),
        ({"networkPolicy": {"metrics": {"from": [{}]}}}, "/networkPolicy/metrics/from/0"),
        ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
        ({"kvTransfer": {"portRange": {"min": 80, "max": 90}}}, "/kvTransfer/portRange/min"),
        ({"kvTransfer": {"portRange": {"min": 17000, "max": 15000}}}, "min 17000 is above max"),
    ],
)
def test_bad_values_rejected(values, where):
    import helm_python

    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmError)) as err:
        helm.render(values)
    assert where in str(err.value)
