"""The chart's tensor parallelism: `<pool>.tensorParallelSize` becomes the workers'
`--tensor-parallel-size`, one GPU per rank is requested on GPU pools, /dev/shm is a
Memory volume of `shmSize`, and a size that is not a positive integer is refused (by the
schema, and by the template when the schema is skipped)."""

from __future__ import annotations

import shutil

import pytest

from tests.deploy import helm
from tests.deploy.helm import container, find, name, resources, worker_cli

pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

GPU_POOL = {"engine": {"device": "cuda"}, "gpu": {"count": 1}}


def _pools(values: dict) -> dict[str, dict]:
    docs = helm.render(values)
    return {role: find(docs, "Deployment", name(role)) for role in ("prefill", "decode")}


def test_default_is_one_rank_and_no_gpu():
    for dep in _pools({}).values():
        args = container(dep)["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "1"
        assert worker_cli(dep).tensor_parallel_size == 1
        requests, limits = resources(dep)
        assert not any("gpu" in k for k in {**requests, **limits})


def test_sizes_per_pool_and_one_gpu_per_rank():
    pools = _pools(
        {
            "prefill": {**GPU_POOL, "tensorParallelSize": 2},
            "decode": {**GPU_POOL, "tensorParallelSize": 4, "shmSize": "8Gi"},
        }
    )
    for role, tp in (("prefill", 2), ("decode", 4)):
        dep = pools[role]
        helm.validate(dep)
        cli = worker_cli(dep)
        assert (cli.tensor_parallel_size, cli.device) == (tp, "cuda")
        requests, limits = resources(dep)
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == tp
        # NCCL's shared memory: a Memory emptyDir at /dev/shm, sized by shmSize
        pod = dep["spec"]["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi" if tp == 4 else "1Gi"}
        mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "shm")
        assert mount["mountPath"] == "/dev/shm"


@pytest.mark.parametrize(
    "gpu,tp,expected",
    [
        ({"count": 1}, 2, 2),  # raised to one per rank
        ({"count": 8}, 2, 8),  # more than the ranks: kept
        ({"count": 1, "resource": "amd.com/gpu"}, 4, 4),
        ({"count": 0}, 2, None),  # no GPU resource (GPUs visible another way)
    ],
)
def test_gpu_request_follows_the_ranks(gpu, tp, expected):
    dep = _pools({"decode": {"engine": {"device": "cuda"}, "gpu": gpu, "tensorParallelSize": tp}})
    requests, limits = resources(dep["decode"])
    key = gpu.get("resource", "nvidia.com/gpu")
    assert requests.get(key) == limits.get(key) == expected
    assert worker_cli(dep["decode"]).tensor_parallel_size == tp


def test_cpu_ranks_need_no_gpu():
    dep = _pools({"prefill": {"tensorParallelSize": 2}})["prefill"]
    cli = worker_cli(dep)
    assert (cli.device, cli.tensor_parallel_size) == ("cpu", 2)
    requests, limits = resources(dep)
    assert not any("gpu" in k for k in {**requests, **limits})


def test_tp_example():
    pools = _pools(helm.load_values("tp-llama-70b"))
    for role, tp in (("prefill", 2), ("decode", 4)):
        dep = pools[role]
        assert worker_cli(dep).tensor_parallel_size == tp
        requests, limits = resources(dep)
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == tp
        shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None])
def test_schema_refuses_a_bad_size(bad):
    import helm_python

    with pytest.raises(helm_python.HelmValuesError) as err:
        helm.render({"decode": {"tensorParallelSize": bad}})
    # null deletes the key in Helm: then it is reported missing
    assert "/decode" in str(err.value) and "tensorParallelSize" in str(err.value)


@pytest.mark.parametrize("bad", [0, 1.5, None])
def test_template_refuses_a_bad_size_without_the_schema(bad, tmp_path):
    """`helm install --skip-schema-validation`: the template's own check still fails."""
    import helm_python

    chart = tmp_path / "pdserve"
    shutil.copytree(helm.CHART, chart)
    (chart / "values.schema.json").unlink()
    with helm_python.Chart.load(chart) as loaded:
        with pytest.raises(helm_python.HelmRenderError) as err:
            loaded.render({"prefill": {"tensorParallelSize": bad}}, name="x", namespace="y")
    assert "prefill.tensorParallelSize must be a positive integer" in str(err.value)
