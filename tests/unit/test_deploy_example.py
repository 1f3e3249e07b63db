"""The Kubernetes example (docs/deploy/kubernetes.yaml) is valid against Kubernetes' own
schemas (kubernetes-validate, strict: no unknown fields) and consistent with itself and the
CLI: the router names every StatefulSet replica by its headless-Service DNS name, the
probes ask the container's port (readiness: /health; the router's liveness: /metrics, so
replicas being down never restarts it), and each command parses as `bin/engine serve`."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "deploy" / "kubernetes.yaml"
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def resources() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_every_resource_is_valid_kubernetes(resources):
    assert set(resources) == {
        "Service/kvactor-replica",
        "StatefulSet/kvactor-replica",
        "Deployment/kvactor-router",
        "Service/kvactor",
        "Secret/kvactor",
    }
    for resource in resources.values():
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_the_router_names_every_replica(resources):
    replicas = resources["StatefulSet/kvactor-replica"]["spec"]
    service = replicas["serviceName"]
    assert resources[f"Service/{service}"]["spec"]["clusterIP"] == "None"
    command = resources["Deployment/kvactor-router"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    named = [command[i + 1] for i, arg in enumerate(command) if arg == "--replica"]
    expected = [f"http://kvactor-replica-{i}.{service}:8000" for i in range(replicas["replicas"])]
    assert named == expected


def test_probes_and_commands(resources):
    from actors.app.cli import serve_parser

    for name in ("StatefulSet/kvactor-replica", "Deployment/kvactor-router"):
        container = resources[name]["spec"]["template"]["spec"]["containers"][0]
        port = container["ports"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["port"] == port["name"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        # a replica stuck is restarted; the router is alive whatever its replicas' state
        live = "/metrics" if "router" in name else "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == live
        assert container["command"][:2] == ["bin/engine", "serve"]
        args = serve_parser().parse_args(container["command"][2:])
        assert args.port == port["containerPort"] and args.host == "0.0.0.0"
