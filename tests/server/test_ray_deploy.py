"""The Kubernetes and `serve run` files in deploy/ (never run on a cluster here): the KubeRay RayService's
fields (GPU worker pods, one replica per GPU, readiness on /ready, the gRPC port on the pod that runs the
ingress), both Serve configs validated by Ray Serve's own schema, and their application args accepted by
tilevox's builder; plus the `tilevox serve --ray` option checks that fail before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tilevox.server.cli import main

schema = pytest.importorskip("ray.serve.schema", reason="Ray Serve is not installed (pip install 'tilevox[ray]')")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _check_serve_config(config: dict) -> dict:
    """Valid for Ray Serve (its pydantic schema), one tilevox application built by our builder; returns its args."""
    schema.ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "tilevox.server.ray_serve:app_builder" and app["route_prefix"] == "/"
    from tilevox.server.ray_serve import app_builder

    app_builder(app["args"])  # parses serve_args and lays out the deployments
    return app["args"]


def test_serve_run_config_is_a_valid_serve_config():
    args = _check_serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    assert args["num_replicas"] == 2 and "--max-streams" in args["serve_args"]


def test_rayservice_manifest_fields():
    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    spec = manifest["spec"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    args = _check_serve_config(serve_config)
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0" and cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    # one replica per GPU: each GPU pod offers one GPU to Ray, and each replica asks for one
    assert workers["rayStartParams"]["num-gpus"] == "1" and args["gpus_per_replica"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    low, high = (int(n) for n in args["autoscale"].split(":"))
    assert workers["minReplicas"] >= low and workers["maxReplicas"] == high  # a pod for every replica
    assert "--device cuda" in args["serve_args"]
    probe = container["readinessProbe"]["httpGet"]
    assert probe == {"path": "/ready", "port": 8000}
    # the ingress (and its gRPC front end) is pinned to the head, which exposes the gRPC port
    head = cluster["headGroupSpec"]
    assert json.loads(json.loads(head["rayStartParams"]["resources"])) == {"tilevox_ingress": 1}  # KubeRay quoting
    (ingress,) = serve_config["applications"][0]["deployments"]
    assert ingress["name"] == "TilevoxIngress" and ingress["ray_actor_options"]["resources"] == {"tilevox_ingress": 1}
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {8000, 50051} <= head_ports and "--grpc-port 50051" in args["serve_args"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ray", "--model", "random:llama-tiny", "--max-streams", "4"], "--device is required with Ray"),
        (["--ray", "--max-streams", "4", "--autoscale", "2"], "--autoscale must be MIN:MAX"),
        (["--ray", "--max-streams", "4", "--autoscale", "3:2"], "0 <= MIN <= MAX"),
        (["--ray", "--max-streams", "4", "--num-replicas", "2", "--autoscale", "1:2"], "not both"),
        (["--num-replicas", "2"], "need --ray"),
    ],
)
def test_ray_options_fail_before_anything_starts(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
