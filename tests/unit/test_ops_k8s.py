"""ops/k8s/: schema-valid manifests (kubernetes-validate, strict) that fit together.

The core kinds are checked against the Kubernetes 1.37 OpenAPI schemas kubernetes-validate
ships; the ServiceMonitor is a CRD it has no schema for, so it is checked against the subset of
the Prometheus Operator's monitoring.coreos.com/v1 schema written below (the fields used here,
no others allowed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from odbd.cli import apply_environment, config_from_args, daemon_parser
from odbd.errors import ConfigError

K8S = Path(__file__).resolve().parents[2] / "ops" / "k8s"
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m)$"},
                        },
                    },
                },
            },
        },
    },
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def test_every_core_manifest_is_valid_against_the_kubernetes_schemas():
    kinds = set()
    for doc in documents():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    assert kinds == {"ConfigMap", "Service", "Job", "ServiceMonitor"}


def test_the_validator_rejects_a_misspelt_field():
    job = one("Job")
    job["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.37.0", strict=True)


def test_the_service_monitor_matches_the_operator_schema_and_the_service():
    monitor, service = one("ServiceMonitor"), one("Service")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def pod() -> dict[str, Any]:
    return one("Job")["spec"]["template"]["spec"]


def sidecar() -> dict[str, Any]:
    (odbd,) = [c for c in pod()["initContainers"] if c["name"] == "odbd"]
    return odbd


def test_odbd_is_a_native_sidecar_sharing_memory_backed_shm_with_the_trainer():
    spec = pod()
    assert sidecar()["restartPolicy"] == "Always"
    (trainer,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    for container in (sidecar(), trainer):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts["/run/odbd"] == "run"
        assert container["resources"]["limits"]["memory"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["ODBD_SOCKET"] == one("ConfigMap")["data"]["ODBD_SOCKET"]


def test_probes_use_grpc_health_on_the_health_listener():
    config = one("ConfigMap")["data"]
    port = int(config["ODBD_HEALTH_LISTEN"].rsplit(":", 1)[1])
    odbd = sidecar()
    assert odbd["startupProbe"]["grpc"]["port"] == port
    assert odbd["readinessProbe"]["grpc"]["port"] == port
    # Liveness must not kill a draining daemon (NOT_SERVING): it only checks the port.
    assert odbd["livenessProbe"]["tcpSocket"]["port"] == port


def test_peers_resolve_through_the_headless_service_by_pod_index():
    job, service, config = one("Job"), one("Service"), one("ConfigMap")["data"]
    name = job["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    peer_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "peer")
    nodes = job["spec"]["completions"]
    want = [f"{name}-{i}.{service['metadata']['name']}:{peer_port}" for i in range(nodes)]
    assert config["ODBD_PEERS"].split(",") == want
    assert int(config["ODBD_WORLD"]) == nodes * int(config["ODBD_NPROC_PER_NODE"])
    container_ports = {p["name"] for c in (sidecar(), *pod()["containers"]) for p in c["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_every_configured_variable_is_a_daemon_flag():
    flags = {"ODBD_" + a.dest.upper() for a in daemon_parser()._actions if a.option_strings}
    names = set(one("ConfigMap")["data"]) | {e["name"] for e in sidecar()["env"]}
    assert not names - flags, f"not odbd flags: {names - flags}"


def test_the_drain_fits_in_the_termination_grace_period():
    config = one("ConfigMap")["data"]
    assert pod()["terminationGracePeriodSeconds"] > float(config["ODBD_DRAIN_TIMEOUT"])


def test_the_sidecar_proves_a_secret_mounted_token_and_passes_protected_mode(tmp_path):
    """Issue 29: the shipped config listened on 0.0.0.0 with no token; now odbd would refuse
    it (protected mode), so the Job mounts a Secret and the ConfigMap points at it."""
    config = one("ConfigMap")["data"]
    token_file = Path(config["ODBD_JOB_TOKEN_FILE"])
    volumes = {v["name"]: v for v in pod()["volumes"]}
    (mount,) = [m for m in sidecar()["volumeMounts"] if token_file.is_relative_to(m["mountPath"])]
    assert mount.get("readOnly") and "secret" in volumes[mount["name"]]
    secret = volumes[mount["name"]]["secret"]
    assert token_file.name in (secret.get("items") or [{"path": "token"}])[0]["path"]
    assert secret["defaultMode"] & 0o007 == 0  # not readable by others
    (trainer,) = pod()["containers"]
    assert all(m["name"] != mount["name"] for m in trainer["volumeMounts"])
    # The daemon accepts the shipped settings with a token, and refuses them without one.
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    env = {**config, "ODBD_NODE_RANK": "0", "ODBD_SOCKET": str(tmp_path / "s.sock")}
    env.pop("ODBD_DATASET")
    env["ODBD_DATASET_SIZE"] = "100"
    assert parse_env({**env, "ODBD_JOB_TOKEN_FILE": str(token)}).job_token
    del env["ODBD_JOB_TOKEN_FILE"]
    with pytest.raises(ConfigError, match="--job-token-file.*--tls-cert.*--insecure"):
        parse_env(env)


def parse_env(env: dict[str, str]) -> Any:
    parser = daemon_parser()
    apply_environment(parser, env)
    return config_from_args(parser.parse_args([]), env)
