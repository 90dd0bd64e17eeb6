"""The deployment files under infra/ agree with the code: settings, ports, probe paths, queues, pins,
metrics. No Docker daemon or cluster is needed: the files are parsed and compared with what the code
defines, so a renamed setting, port, route, queue or metric fails here instead of in a deployment.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bulkinfer.jobs.names import CONTROL_QUEUE, model_queue
from bulkinfer.jobs.settings import CONFIG_ENV, ENVIRONMENT_NAMES, Settings

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
DOCKER = INFRA / "docker"
K8S = INFRA / "k8s"
COMPOSE_FILE = INFRA / "compose" / "docker-compose.yml"
PROMETHEUS_FILE = INFRA / "prometheus" / "prometheus.yml"
DASHBOARD_FILE = INFRA / "grafana" / "bulkinfer-dashboard.json"
STATUS_SERVER = REPO / "worker" / "process" / "status_server.py"
DOCKERFILES = {"api": DOCKER / "Dockerfile.api", "worker": DOCKER / "Dockerfile.worker",
               "worker-cpu": DOCKER / "Dockerfile.worker-cpu"}
# The files whose BULKINFER_* names must all be settings (infra/examples/ has its own variables).
DEPLOYMENT_FILES = [*sorted(path for folder in ("docker", "compose", "k8s", "prometheus", "grafana")
                           for path in (INFRA / folder).rglob("*") if path.is_file()),
                    REPO / "docs" / "deployment.md"]
YAML_FILES = sorted(path for path in INFRA.rglob("*") if path.suffix in (".yml", ".yaml"))
SETTING_VARIABLES = set(ENVIRONMENT_NAMES.values())
DEFAULTS = Settings()

# What a deployed process cannot start (or reach its peers) without.
COMMON_NEEDS = {"BULKINFER_BROKER_URL", "BULKINFER_STORE_URI", "BULKINFER_S3_ENDPOINT_URL",
                "BULKINFER_MODELS"}
API_NEEDS = COMMON_NEEDS | {"BULKINFER_API_HOST"}
WORKER_NEEDS = COMMON_NEEDS | {"BULKINFER_MODEL_CACHE"}

# The contract between the dashboard and the code: the metric names the worker (worker/process/metrics.py)
# and the API (/metrics) export. Renaming a metric in the code means changing it here and in
# infra/grafana/bulkinfer-dashboard.json together; these tests fail until both are done.
WORKER_METRICS = {
    "bulkinfer_worker_rows_total", "bulkinfer_worker_tokens_total", "bulkinfer_worker_shards_total",
    "bulkinfer_time_to_first_token_seconds", "bulkinfer_time_per_output_token_seconds",
    "bulkinfer_engine_prefix_cache_hit_ratio", "bulkinfer_engine_kv_blocks_used",
    "bulkinfer_engine_kv_blocks_total", "bulkinfer_engine_running_requests",
    "bulkinfer_engine_waiting_requests", "bulkinfer_engine_preemptions_total",
    "bulkinfer_engine_load_seconds",
    "bulkinfer_task_retries_total", "bulkinfer_reaper_resends_total", "bulkinfer_store_errors_total",
    "bulkinfer_redis_errors_total",
    # The prefix KV tier across workers (worker/kv/metrics.py).
    "bulkinfer_kv_store_hit_blocks_total", "bulkinfer_kv_store_miss_blocks_total",
    "bulkinfer_kv_store_loaded_bytes_total", "bulkinfer_kv_store_saved_bytes_total",
    "bulkinfer_kv_store_load_seconds_total", "bulkinfer_kv_store_failed_loads_total",
    "bulkinfer_kv_store_failed_saves_total", "bulkinfer_kv_store_corrupt_blocks_total",
}
API_METRICS = {"bulkinfer_jobs", "bulkinfer_queue_length", "bulkinfer_workers"}
HISTOGRAMS = {"bulkinfer_time_to_first_token_seconds", "bulkinfer_time_per_output_token_seconds"}


# ---- reading the files ---------------------------------------------------------------------------
def load_yaml(path: Path) -> list[Any]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document is not None]


def k8s_objects() -> list[dict[str, Any]]:
    return [document for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for document in load_yaml(path)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found = [item for item in k8s_objects() if item["kind"] == kind and item["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} under infra/k8s, found {len(found)}"
    return found[0]


def kustomization() -> dict[str, Any]:
    return load_yaml(K8S / "kustomization.yaml")[0]


def only_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_env(container: dict[str, Any]) -> dict[str, str | None]:
    """The variables a k8s container gets: its ConfigMaps' and Secrets' keys (envFrom), then its own
    `env` (a value from a secretKeyRef is None: only its presence is known)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(k8s_object("ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(k8s_object("Secret", source["secretRef"]["name"])["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    return env


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)[0]


def compose_default(value: str) -> str:
    """`${VAR:-default}` → default: the value compose uses when VAR is unset."""
    return re.sub(r"\$\{[A-Za-z0-9_]+:-([^}]*)\}", r"\1", value)


def compose_env(service: str) -> dict[str, str]:
    environment = compose()["services"][service].get("environment", {})
    assert isinstance(environment, dict), f"compose service {service}: environment must be a mapping"
    return {name: compose_default(str(value)) for name, value in environment.items()}


def port_in(env: dict[str, str | None], variable: str, default: int) -> int:
    """The port a process listens on given its environment (an empty variable counts as unset)."""
    value = env.get(variable)
    return int(value) if value else default


def instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(index for index, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def status_server_constants() -> dict[str, str]:
    """worker/process/status_server.py's path constants, read without importing it (that imports torch)."""
    if not STATUS_SERVER.is_file():
        pytest.fail("worker/process/status_server.py is missing: the worker's /metrics, /healthz and /readyz "
                    "endpoint (METRICS_PATH, HEALTH_PATH, READY_PATH) must exist for the probes to work")
    constants = {}
    for node in ast.parse(STATUS_SERVER.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("METRICS_PATH", "HEALTH_PATH", "READY_PATH"):
                constants[node.targets[0].id] = ast.literal_eval(node.value)
    missing = {"METRICS_PATH", "HEALTH_PATH", "READY_PATH"} - set(constants)
    assert not missing, f"worker/process/status_server.py does not define {sorted(missing)}"
    return constants


def worker_extra_pins() -> dict[str, str]:
    """{"torch": "2.13.0", "xgrammar": …}: the exact pins of pyproject's `worker` extra."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    pins = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", item).groups()
                for item in extra if "==" in item)
    assert {"torch", "xgrammar"} <= set(pins), "pyproject's worker extra no longer pins torch and xgrammar"
    return pins


# ---- every file parses ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", YAML_FILES, ids=lambda path: str(path.relative_to(INFRA)))
def test_yaml_file_parses(path: Path) -> None:
    documents = load_yaml(path)
    assert documents, f"{path} is empty"
    if path.parent == K8S:
        for document in documents:  # kubectl rejects an object without these
            assert document.get("apiVersion") and document.get("kind"), f"{path}: apiVersion and kind"


def test_dashboard_parses_and_asks_for_its_datasource() -> None:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    variables = {item["name"]: item for item in dashboard["templating"]["list"]}
    # Importable into any Grafana: panels name the datasource through the variable, never by a uid.
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"])


# ---- settings ------------------------------------------------------------------------------------
def test_every_bulkinfer_variable_named_in_the_deployment_files_is_a_setting() -> None:
    # A typo (BULKINFER_BROKER_URI) would be silently ignored by the processes; here it fails. The
    # client's own variables (the CLI's API URL and key) may be named in the docs.
    from bulkinfer.api.client.client import API_KEY_ENV, API_URL_ENV

    # The engine's own variable: where its compiled CPU kernels are cached (read without importing
    # engine/, which imports torch).
    kernels = (REPO / "engine" / "cpu_kernels" / "__init__.py").read_text()
    kernel_cache = re.search(r'^CACHE_ENV = "(BULKINFER_[A-Z_]+)"', kernels, re.M)
    assert kernel_cache, "engine/cpu_kernels no longer names its cache variable CACHE_ENV"
    # And where the presets' checkpoints are built (engine/checkpoints.py, also torch's side).
    checkpoints = (REPO / "engine" / "checkpoints.py").read_text()
    checkpoint_cache = re.search(r'^CACHE_DIR_ENV = "(BULKINFER_[A-Z_]+)"', checkpoints, re.M)
    assert checkpoint_cache, "engine/checkpoints.py no longer names its cache variable CACHE_DIR_ENV"
    allowed = SETTING_VARIABLES | {CONFIG_ENV, API_URL_ENV, API_KEY_ENV, kernel_cache[1], checkpoint_cache[1]}
    unknown = {f"{path.relative_to(REPO)}: {name}" for path in DEPLOYMENT_FILES
               for name in re.findall(r"\bBULKINFER_[A-Z0-9_]+", path.read_text()) if name not in allowed}
    assert not unknown, f"not settings (jobs/settings.py ENVIRONMENT_NAMES): {sorted(unknown)}"


def test_compose_api_and_workers_share_the_settings_anchor_and_get_what_they_need() -> None:
    shared = {name: compose_default(str(value)) for name, value in compose()["x-bulkinfer-env"].items()}
    for service, needs in (("api", API_NEEDS), ("worker-cpu", WORKER_NEEDS), ("worker-gpu", WORKER_NEEDS)):
        env = compose_env(service)
        assert shared.items() <= env.items(), f"compose {service}: not built on x-bulkinfer-env"
        assert needs <= set(env), f"compose {service} lacks {sorted(needs - set(env))}"
        assert all(env[name] for name in needs - {"BULKINFER_S3_ENDPOINT_URL"}), f"compose {service}: empty"
    # A containerised API must listen on every interface, or nothing outside its container reaches it.
    assert compose_env("api")["BULKINFER_API_HOST"] == "0.0.0.0"


def test_k8s_api_and_worker_get_what_they_need() -> None:
    for name, needs in (("bulkinfer-api", API_NEEDS), ("bulkinfer-worker", WORKER_NEEDS)):
        env = container_env(only_container(k8s_object("Deployment", name)))
        assert needs <= set(env), f"k8s {name} lacks {sorted(needs - set(env))}"
    api_env = container_env(only_container(k8s_object("Deployment", "bulkinfer-api")))
    assert api_env["BULKINFER_API_HOST"] == "0.0.0.0"
    worker_env = container_env(only_container(k8s_object("Deployment", "bulkinfer-worker")))
    # The cache must be the volume, or each model download lands in the container's throwaway layer.
    mounts = {mount["mountPath"] for mount in only_container(k8s_object("Deployment", "bulkinfer-worker"))
              ["volumeMounts"]}
    assert worker_env["BULKINFER_MODEL_CACHE"] in mounts


def test_k8s_secrets_are_not_in_the_configmap() -> None:
    data = k8s_object("ConfigMap", "bulkinfer-config")["data"]
    secret_names = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "BULKINFER_API_KEYS",
                    "BULKINFER_ADMIN_API_KEYS", "BULKINFER_WEBHOOK_SECRET"}
    assert not secret_names & set(data)
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "BULKINFER_API_KEYS"} <= set(
        k8s_object("Secret", "bulkinfer-secrets")["stringData"])


def test_k8s_secret_references_name_keys_the_secret_has() -> None:
    # The references are optional (IRSA needs no AWS keys), so a misspelt key would silently leave
    # the variable unset: an API without its keys would run open.
    for item in k8s_objects():
        if item["kind"] != "Deployment":
            continue
        for variable in only_container(item).get("env", []):
            reference = variable.get("valueFrom", {}).get("secretKeyRef")
            if reference:
                secret = k8s_object("Secret", reference["name"])
                assert reference["key"] in secret["stringData"], f"{item['metadata']['name']}: {reference}"


# ---- ports and probe paths -----------------------------------------------------------------------
def test_status_server_paths_are_the_ones_the_probes_use() -> None:
    paths = status_server_constants()
    worker = k8s_object("Deployment", "bulkinfer-worker")
    container = only_container(worker)
    assert container["startupProbe"]["httpGet"]["path"] == paths["READY_PATH"]
    assert container["readinessProbe"]["httpGet"]["path"] == paths["READY_PATH"]
    assert container["livenessProbe"]["httpGet"]["path"] == paths["HEALTH_PATH"]
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == paths["METRICS_PATH"]
    for name in ("worker", "worker-cpu"):
        healthcheck = " ".join(args for word, args in final_stage(DOCKERFILES[name]) if word == "HEALTHCHECK")
        assert paths["HEALTH_PATH"] in healthcheck, f"Dockerfile.{name}'s HEALTHCHECK"
    prometheus = load_yaml(PROMETHEUS_FILE)[0]
    assert {job["metrics_path"] for job in prometheus["scrape_configs"]} == {paths["METRICS_PATH"]}


def test_api_healthz_and_metrics_are_routes_and_healthz_is_open_to_probes() -> None:
    from bulkinfer.api.auth import OPEN_PATHS
    from bulkinfer.api.routes.observe import router as observe_router
    from bulkinfer.api.routes.service import router

    assert "/healthz" in {route.path for route in router.routes}
    # Prometheus (compose's scrape config, the pods' annotations) reads the API's /metrics.
    api_annotations = k8s_object("Deployment", "bulkinfer-api")["spec"]["template"]["metadata"]["annotations"]
    assert api_annotations["prometheus.io/path"] in {route.path for route in observe_router.routes}
    # Probes send no API key: with keys configured, a closed /healthz would answer 401 and fail them.
    assert "/healthz" in OPEN_PATHS
    container = only_container(k8s_object("Deployment", "bulkinfer-api"))
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    healthcheck = " ".join(args for word, args in final_stage(DOCKERFILES["api"]) if word == "HEALTHCHECK")
    assert "/healthz" in healthcheck


def named_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(item["containerPort"] for item in container["ports"] if item.get("name") == port)


def test_k8s_ports_are_the_ones_the_processes_listen_on() -> None:
    api = only_container(k8s_object("Deployment", "bulkinfer-api"))
    api_port = port_in(container_env(api), "BULKINFER_API_PORT", DEFAULTS.api_port)
    assert [item["containerPort"] for item in api["ports"]] == [api_port]
    for probe in ("readinessProbe", "livenessProbe"):
        action = api[probe].get("httpGet") or api[probe]["tcpSocket"]
        assert named_port(api, action["port"]) == api_port, probe
    service = k8s_object("Service", "bulkinfer-api")
    assert [named_port(api, item["targetPort"]) for item in service["spec"]["ports"]] == [api_port]

    worker_deployment = k8s_object("Deployment", "bulkinfer-worker")
    worker = only_container(worker_deployment)
    metrics_port = port_in(container_env(worker), "BULKINFER_WORKER_METRICS_PORT",
                           DEFAULTS.worker_metrics_port)
    assert metrics_port != 0, "the worker's probes need its status endpoint (port 0 turns it off)"
    assert [item["containerPort"] for item in worker["ports"]] == [metrics_port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert named_port(worker, worker[probe]["httpGet"]["port"]) == metrics_port, probe
    annotations = worker_deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)


def test_compose_and_prometheus_ports_are_the_ones_the_processes_listen_on() -> None:
    api_port = port_in(compose_env("api"), "BULKINFER_API_PORT", DEFAULTS.api_port)
    published = [compose_default(str(item)).rsplit(":", 1)[-1]
                 for item in compose()["services"]["api"]["ports"]]
    assert published == [str(api_port)]
    worker_ports = set()
    for service in ("worker-cpu", "worker-gpu"):
        port = port_in(compose_env(service), "BULKINFER_WORKER_METRICS_PORT", DEFAULTS.worker_metrics_port)
        assert compose()["services"][service]["expose"] == [str(port)]
        worker_ports.add(port)
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS_FILE)[0]["scrape_configs"]}
    assert jobs["bulkinfer-api"]["static_configs"][0]["targets"] == [f"api:{api_port}"]
    discovery = jobs["bulkinfer-worker"]["dns_sd_configs"][0]
    assert set(discovery["names"]) == {"worker-cpu", "worker-gpu"} <= set(compose()["services"])
    assert {discovery["port"]} == worker_ports


def test_dockerfiles_expose_and_check_the_default_ports() -> None:
    worker_port = ("BULKINFER_WORKER_METRICS_PORT", DEFAULTS.worker_metrics_port)
    for name, (variable, port) in (("api", ("BULKINFER_API_PORT", DEFAULTS.api_port)),
                                   ("worker", worker_port), ("worker-cpu", worker_port)):
        stage = final_stage(DOCKERFILES[name])
        assert [args for word, args in stage if word == "EXPOSE"] == [str(port)], name
        healthchecks = [args for word, args in stage if word == "HEALTHCHECK"]
        assert len(healthchecks) == 1, f"Dockerfile.{name} needs one HEALTHCHECK"
        # The check follows the port setting, so a moved port does not make a healthy container unhealthy.
        assert variable in healthchecks[0] and f"'{port}'" in healthchecks[0], name


def test_graceful_shutdown_has_time_to_hand_shards_back() -> None:
    # Docker's and Kubernetes' 10 s / 30 s defaults could cut a worker's hand-back short.
    worker = k8s_object("Deployment", "bulkinfer-worker")
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
    for service in ("worker-cpu", "worker-gpu"):
        assert compose()["services"][service]["stop_grace_period"] == "60s"


# ---- queues and scaling --------------------------------------------------------------------------
def served_models(container: dict[str, Any]) -> list[str]:
    command = container["command"]
    return [command[index + 1] for index, word in enumerate(command) if word == "--model"]


def test_keda_scales_the_worker_on_the_queues_its_tasks_wait_in() -> None:
    scaled = k8s_object("ScaledObject", "bulkinfer-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "bulkinfer-worker"
    worker = only_container(k8s_object("Deployment", "bulkinfer-worker"))
    models = served_models(worker)
    registry = json.loads(k8s_object("ConfigMap", "bulkinfer-config")["data"]["BULKINFER_MODELS"])
    assert models and set(models) <= set(registry), "the worker's --model must be a ConfigMap registry model"
    triggers = scaled["spec"]["triggers"]
    assert {trigger["type"] for trigger in triggers} == {"redis"}
    # The model's shard queue, and the control queue: without it a job submitted while no worker runs
    # would never be planned, so its shards would never be queued.
    assert {trigger["metadata"]["listName"] for trigger in triggers} == \
        {model_queue(name) for name in models} | {CONTROL_QUEUE}
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["cooldownPeriod"] >= 300
    assert "replicas" not in k8s_object("Deployment", "bulkinfer-worker")["spec"], "KEDA owns the count"


def test_keda_reads_the_redis_the_workers_use() -> None:
    # KEDA runs in its own namespace: it needs Redis' full service name, in the namespace kustomize sets.
    broker = k8s_object("ConfigMap", "bulkinfer-config")["data"]["BULKINFER_BROKER_URL"]
    match = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/(\d+)", broker)
    assert match, f"unexpected broker URL {broker!r}"
    host, port, database = match.groups()
    redis_service = k8s_object("Service", host)
    assert [item["port"] for item in redis_service["spec"]["ports"]] == [int(port)]
    for trigger in k8s_object("ScaledObject", "bulkinfer-worker")["spec"]["triggers"]:
        metadata = trigger["metadata"]
        assert metadata["address"] == f"{host}.{kustomization()['namespace']}.svc.cluster.local:{port}"
        assert metadata.get("databaseIndex", "0") == database
        assert int(metadata["listLength"]) >= 1 and int(metadata["activationListLength"]) >= 0


def test_redis_keeps_the_queues_across_restarts() -> None:
    redis_args = only_container(k8s_object("StatefulSet", "redis"))["args"]
    compose_args = compose()["services"]["redis"]["command"]
    for args in (redis_args, compose_args):
        joined = " ".join(args)
        assert "--appendonly yes" in joined and "--maxmemory-policy noeviction" in joined


def test_kustomization_lists_every_manifest_and_image() -> None:
    manifests = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == manifests
    images = {only_container(item)["image"] for item in k8s_objects() if item["kind"] == "Deployment"}
    assert images == {image["name"] for image in kustomization()["images"]}


def test_k8s_worker_asks_for_one_gpu_and_runs_as_non_root() -> None:
    worker = k8s_object("Deployment", "bulkinfer-worker")
    assert only_container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
    # An engine spans as many GPUs (tensor-parallel ranks) as the pod asks for.
    assert container_env(only_container(worker))["BULKINFER_TENSOR_PARALLEL_SIZE"] == "1"
    for name in ("bulkinfer-api", "bulkinfer-worker"):
        context = k8s_object("Deployment", name)["spec"]["template"]["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0


# ---- images --------------------------------------------------------------------------------------
def pip_installs(path: Path) -> list[str]:
    return [args for word, args in instructions(path) if word == "RUN" and "pip install" in args]


def test_worker_images_pin_torch_and_xgrammar_like_pyproject_in_the_same_pip_command() -> None:
    pins = worker_extra_pins()
    for name, variant, index in (("worker", "${TORCH_CUDA}", "https://download.pytorch.org/whl/${TORCH_CUDA}"),
                                 ("worker-cpu", "cpu", "https://download.pytorch.org/whl/cpu")):
        (install,) = pip_installs(DOCKERFILES[name])
        # One command: a second pip run could replace torch with another build (a CUDA one on CPU).
        assert '".[worker]"' in install, name
        assert f'"torch=={pins["torch"]}+{variant}"' in install, name
        assert f'"xgrammar=={pins["xgrammar"]}"' in install, name
        assert index in install, name


def test_api_image_installs_the_server_extra_without_torch() -> None:
    (install,) = pip_installs(DOCKERFILES["api"])
    assert '".[server]"' in install and "torch" not in install
    assert "--api-host" in DOCKERFILES["api"].read_text()  # listens beyond its container


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = [args for word, args in final_stage(DOCKERFILES[name]) if word == "USER"]
    assert users, f"Dockerfile.{name} has no USER: it would run as root"
    user = users[-1].split(":")[0]
    # Numeric: Kubernetes' runAsNonRoot cannot verify a user name.
    assert user.isdigit() and user != "0", f"Dockerfile.{name}: USER {users[-1]}"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerignore_sends_only_what_the_image_copies(name: str) -> None:
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile; without it, .venv (GBs) and
    # .git would be sent as the build context.
    ignore = DOCKERFILES[name].with_name(DOCKERFILES[name].name + ".dockerignore")
    lines = [line for line in ignore.read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    included = {line[1:] for line in lines if line.startswith("!")}
    copied = {source for word, args in instructions(DOCKERFILES[name])
              if word == "COPY" and "--from" not in args for source in args.split()[:-1]}
    assert copied == included, f"{ignore.name} keeps {sorted(included)}, the image copies {sorted(copied)}"
    assert all((REPO / source).exists() for source in copied)


# ---- the dashboard's metrics ---------------------------------------------------------------------
def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    expressions += [item["definition"] for item in dashboard["templating"]["list"] if item["type"] == "query"]
    names = set()
    for name in re.findall(r"\bbulkinfer_[a-z0-9_]+", " ".join(expressions)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        names.add(base if base in HISTOGRAMS else name)
    return names


def test_dashboard_uses_only_contract_metrics_and_shows_each_of_them() -> None:
    used, contract = dashboard_metric_names(), WORKER_METRICS | API_METRICS
    assert used <= contract, f"not in the contract (exported metrics): {sorted(used - contract)}"
    assert contract <= used, f"no panel for {sorted(contract - used)}"


def test_contract_metrics_are_the_names_the_code_exports() -> None:
    # prometheus_client adds `_total` to a counter's name, so the code may spell it without.
    source = "\n".join(path.read_text() for folder in ("api", "worker", "jobs")
                       for path in (REPO / folder).rglob("*.py"))
    missing = sorted(name for name in WORKER_METRICS | API_METRICS
                     if not re.search(rf"[\"']{name.removesuffix('_total')}(_total)?[\"']", source))
    assert not missing, f"the dashboard reads metrics no code under api/, worker/, jobs/ exports: {missing}"


def test_the_gpu_worker_image_runs_its_engines_on_the_gpu() -> None:
    # EngineConfig.device defaults to "cpu": without this, a GPU pod would compute on its CPU.
    dockerfile = (REPO / "infra" / "docker" / "Dockerfile.worker").read_text()
    options = re.search(r"BULKINFER_ENGINE_OPTIONS='(\{[^']*\})'", dockerfile)
    assert options and json.loads(options[1])["device"] == "cuda"
    assert "BULKINFER_ENGINE_OPTIONS" not in (REPO / "infra" / "docker" / "Dockerfile.worker-cpu").read_text()


def test_the_compose_gpu_worker_reserves_as_many_gpus_as_its_engine_spans() -> None:
    gpu = compose()["services"]["worker-gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    size = compose_env("worker-gpu")["BULKINFER_TENSOR_PARALLEL_SIZE"]
    assert device["count"] == "${TENSOR_PARALLEL_SIZE:-1}" and size == "1"
    assert str(gpu["environment"]["BULKINFER_TENSOR_PARALLEL_SIZE"]) == "${TENSOR_PARALLEL_SIZE:-1}"
    assert gpu["shm_size"]  # NCCL's shared memory between the ranks
