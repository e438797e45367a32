"""The Helm chart's tls values: the Secret mounted read-only into the router and both
worker pools, the TLS flags on every command line (parsed by pdserve's own parser and
accepted by its settings once pointed at real certificates), worker probes that speak
mutual TLS, and nothing of it with tls.enabled false."""

from __future__ import annotations

import shutil

import pytest

from tests.deploy import helm
from tests.deploy.helm import container, find, name

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

TLS_DIR = "/etc/pdserve/tls"
TLS = {"tls": {"enabled": True, "secretName": "pdserve-grpc-tls", "serverName": "w.pdserve"}}


def _pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def _tls_volume(dep: dict) -> dict | None:
    return next((v for v in _pod(dep)["volumes"] if v["name"] == "tls"), None)


def _real_files(args: list[str], tmp_path) -> list[str]:
    """The args with the mount path replaced by a folder holding generated files of the
    Secret's key names."""
    from tests.pki import make_pki

    pki = make_pki(tmp_path / "pki")
    for src, dst in ((pki.ca, "ca.crt"), (pki.server.cert, "tls.crt"), (pki.server.key, "tls.key")):
        shutil.copy(src, tmp_path / dst)
    return [a.replace(TLS_DIR, str(tmp_path)) for a in args]


@pytest.fixture(scope="module")
def docs():
    return helm.render(TLS)


def test_renders_valid_and_lint_clean(docs):
    for doc in docs:
        if doc["kind"] not in helm.CRD_KINDS:
            helm.validate(doc)
    report = helm.lint(TLS)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_secret_mounted_read_only_everywhere(docs):
    for component in ("router", "prefill", "decode"):
        dep = find(docs, "Deployment", name(component))
        volume = _tls_volume(dep)
        assert volume["secret"]["secretName"] == "pdserve-grpc-tls"
        assert volume["secret"]["defaultMode"] == 0o440
        (mount,) = [m for m in container(dep)["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}


def test_worker_flags(docs, tmp_path):
    from pdserve.cli import build_parser
    from services.common.settings import WorkerSettings

    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", name(role)))
        args = helm.expand(c["args"], {"POD_IP": helm.POD_IP})[1:]
        parsed = build_parser().parse_args(args)
        assert parsed.tls_cert_file == f"{TLS_DIR}/tls.crt"
        assert parsed.tls_key_file == f"{TLS_DIR}/tls.key"
        assert parsed.tls_ca_file == f"{TLS_DIR}/ca.crt"  # mutual TLS
        if role == "decode":  # it dials prefill pods by IP
            assert parsed.tls_server_name == "w.pdserve"
        real = vars(build_parser().parse_args(_real_files(args, tmp_path / role)))
        settings = WorkerSettings(**{k: v for k, v in real.items() if k.startswith("tls_")})
        assert settings.tls and settings.tls_client_pair == (
            settings.tls_cert_file,
            settings.tls_key_file,
        )


def test_router_flags(docs, tmp_path):
    from pdserve.cli import build_parser
    from router.cli import config_from_args

    c = container(find(docs, "Deployment", name("router")))
    (ref,) = c["envFrom"]
    cm = find(docs, "ConfigMap", ref["configMapRef"]["name"])
    args = helm.expand(c["args"], cm["data"])[1:]
    parsed = build_parser().parse_args(args)
    assert (parsed.worker_tls_ca_file, parsed.worker_tls_cert_file, parsed.worker_tls_key_file) == (
        f"{TLS_DIR}/ca.crt",
        f"{TLS_DIR}/tls.crt",
        f"{TLS_DIR}/tls.key",
    )
    config = config_from_args(build_parser().parse_args(_real_files(args, tmp_path)))
    assert config.worker_tls and config.worker_tls_server_name == "w.pdserve"


def test_worker_probes_speak_mutual_tls(docs):
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", name(role)))
        port = c["ports"][0]["containerPort"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe]  # kubelet's gRPC probe cannot do TLS
            assert c[probe]["exec"]["command"] == [
                "python",
                "/opt/pdserve/healthcheck.py",
                "grpc",
                f"127.0.0.1:{port}",
            ]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PDSERVE_HEALTHCHECK_TLS_CA_FILE"] == f"{TLS_DIR}/ca.crt"
        assert env["PDSERVE_HEALTHCHECK_TLS_CERT_FILE"] == f"{TLS_DIR}/tls.crt"
        assert env["PDSERVE_HEALTHCHECK_TLS_KEY_FILE"] == f"{TLS_DIR}/tls.key"
        assert env["PDSERVE_HEALTHCHECK_TLS_SERVER_NAME"] == "w.pdserve"


def test_off_by_default():
    docs = helm.render({})
    for component in ("router", "prefill", "decode"):
        dep = find(docs, "Deployment", name(component))
        c = container(dep)
        assert _tls_volume(dep) is None
        assert not [a for a in c["args"] if "tls" in a]
        assert not [e for e in c.get("env") or [] if "TLS" in e["name"]]
        if component != "router":
            assert c["readinessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"]


@pytest.mark.parametrize(
    "values,where",
    [
        ({"tls": {"enabled": True}}, "secretName"),
        ({"tls": {"enabled": True, "secretName": "s", "serverName": "a b"}}, "serverName"),
        ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
        ({"tls": {"ca": "x"}}, "ca"),
    ],
)
def test_bad_tls_values_rejected(values, where):
    import helm_python

    with pytest.raises(helm_python.HelmValuesError) as err:
        helm.render(values)
    assert where in str(err.value)
