"""The production deployment files: cluster.yaml passes Ray's own validation (as `ray up` runs it) and keeps its
promises (only SSH open, no keys, big /dev/shm, ulimit, NVMe, staged model); configs/qwen3.6-27b.yaml loads and
every engine and sampling key is one vLLM knows."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import re
from typing import get_args

import pytest
import yaml

from job.config import load_config
from job.drafters import every_trainer_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_YAML = os.path.join(ROOT, "cluster.yaml")
PROD_CONFIG = os.path.join(ROOT, "configs", "qwen3.6-27b.yaml")


@pytest.fixture(scope="module")
def cluster() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


def test_ray_validates_cluster_yaml(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(cluster)  # the file as written
    validate_config(prepare_config(copy.deepcopy(cluster)))  # after Ray fills its AWS defaults, as `ray up` does


def test_node_types(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0  # no work on the head
    assert not head["node_config"]["InstanceType"].startswith(("p", "g"))
    b200, h200 = types["gpu_b200"], types["gpu_h200"]
    assert b200["node_config"]["InstanceType"] == "p6-b200.48xlarge" and b200["min_workers"] >= 1
    assert h200["node_config"]["InstanceType"] == "p5en.48xlarge"
    for t in (b200, h200):
        assert t["resources"]["GPU"] == 8
        assert t["node_config"]["IamInstanceProfile"]["Name"]  # S3 through an instance profile
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cluster["max_workers"]


def test_security_and_credentials(cluster):
    text = open(CLUSTER_YAML).read()
    assert "IpPermissions" not in cluster["provider"].get("security_group", {})  # only Ray's SSH + intra-cluster
    for secret in ("aws_access_key_id", "aws_secret_access_key", "AWS_SECRET", "AKIA"):
        assert secret.lower() not in text.lower()
    # Ray token auth on, with the token file mounted from the laptop (never written into this file).
    assert "--env RAY_AUTH_MODE=token" in cluster["docker"]["run_options"]
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head_start = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start  # dashboard/job API only through `ray dashboard` tunnel
    # The metrics port answers only on the node's cluster address and loopback, on every node type (issue 28).
    port = re.search(r"--metrics-export-port=(\d+)", head_start)[1]
    for name, node in cluster["available_node_types"].items():
        init = " ".join(node.get("initialization_commands", []))
        assert f"--dport {port} ! -i lo ! -d \"$IP\" -j DROP" in init, name
        assert 'if ($i == "src")' in init, name  # $IP: the address the node's default route leaves from


def test_container_runtime(cluster):
    import ray

    docker = cluster["docker"]
    assert f":{ray.__version__}-" in docker["image"]  # cluster Ray == client Ray (pyproject pin)
    run_options = " ".join(docker["run_options"])
    assert "--ulimit nofile=65536:65536" in run_options
    mount = re.search(r"-v (\S+):/mnt/local", run_options)
    assert mount and mount.group(1) == "/opt/dlami/nvme"
    shm = re.search(r"--shm-size=(\d+)g", " ".join(docker["worker_run_options"]))
    assert shm and int(shm.group(1)) >= 64
    starts = " ".join(cluster["worker_start_ray_commands"])
    assert "ulimit -n 65536" in starts and "--object-spilling-directory=/mnt/local/" in starts


def test_model_staged_once_per_node_where_the_config_looks(cluster):
    model = load_config(PROD_CONFIG).model
    assert model.startswith("/mnt/local/models/")
    host_path = model.replace("/mnt/local", "/opt/dlami/nvme")  # the docker mount above
    for name, node_type in cluster["available_node_types"].items():
        init = " ".join(node_type["initialization_commands"])
        assert re.search(rf"aws s3 sync .*s3://\S+ {re.escape(host_path)}\b", init), name
    head_init = " ".join(cluster["available_node_types"][cluster["head_node_type"]]["initialization_commands"])
    assert "--exclude '*.safetensors'" in head_init  # the driver needs the tokenizer, not the weights


def test_production_config_loads_and_vllm_knows_every_key():
    config = load_config(PROD_CONFIG)
    assert config.model.endswith("Qwen3.6-27B") and config.generate.enable_thinking
    s = config.generate.sampling
    assert (s["temperature"], s["top_k"], s["top_p"]) == (1.0, 20, 0.95)
    ek = config.engine_kwargs
    assert ek["max_model_len"] > s["max_tokens"]  # room for the prompt
    assert config.hidden_states.layer_ids == "every_trainer"  # the demo's rule too: one run serves every trainer
    assert config.hidden_states.resolved_layer_ids(64) == every_trainer_layers(64) == [1, 16, 31, 46, 60, 61, 63]
    assert config.hidden_states.last_layer_before_norm
    assert config.quality.canary_rows > 0
    assert ek["max_num_seqs"] == "auto"  # sized per GPU type (test_engine_sizing.py)

    from vllm import SamplingParams
    from vllm.config.speculative import MTPModelTypes
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(ek) <= engine_fields, set(ek) - engine_fields
    assert set(s) <= set(inspect.signature(SamplingParams).parameters)
    assert ek["speculative_config"]["method"] in get_args(MTPModelTypes)


def test_iam_policies_in_the_runbook_are_least_privilege():
    """The policies docs/OPERATIONS.md creates parse as JSON and grant only what the job uses: writes under runs/
    alone (models/ and prompts/ read-only), no S3 or EC2 full access, instance stop/terminate only for this
    cluster's tagged instances."""
    import json
    import re

    text = open(os.path.join(ROOT, "docs", "OPERATIONS.md")).read()
    docs = dict(re.findall(r"cat > /tmp/([\w-]+)\.json <<'?JSON'?\n(.*?)\nJSON\n", text, flags=re.S))
    assert set(docs) == {"ec2-trust", "datagen-s3", "datagen-head", "pods-trust"}, sorted(docs)
    policies = {k: json.loads(v.replace("$BUCKET", "b").replace("$ACCOUNT", "123").replace("$OIDC", "oidc.example"))
                for k, v in docs.items()}
    # KubeRay's pods (EKS IRSA): the role is assumed only through the cluster's OIDC provider, by one service account.
    (trust,) = policies["pods-trust"]["Statement"]
    assert trust["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert trust["Principal"] == {"Federated": "arn:aws:iam::123:oidc-provider/oidc.example"}
    assert trust["Condition"]["StringEquals"]["oidc.example:sub"].startswith("system:serviceaccount:")
    assert "attach-role-policy" not in text and "s3:*" not in text and '"ec2:*"' not in text

    grants = [(a, r) for st in policies["datagen-s3"]["Statement"] for a in _list(st["Action"])
              for r in _list(st["Resource"])]
    writes = {r for a, r in grants if a in ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")}
    assert writes == {"arn:aws:s3:::b/runs/*"}
    assert {r for a, r in grants if a == "s3:GetObject"} == {f"arn:aws:s3:::b/{p}/*" for p in ("models", "prompts",
                                                                                              "runs")}
    head = policies["datagen-head"]["Statement"]
    ends = [st for st in head if "ec2:TerminateInstances" in _list(st["Action"])]
    assert ends and all(st["Condition"]["StringEquals"]["ec2:ResourceTag/ray-cluster-name"] == "drafter-datagen"
                        for st in ends)
    with open(CLUSTER_YAML) as f:
        assert yaml.safe_load(f)["cluster_name"] == "drafter-datagen"  # the tag the terminate condition names
    for role, policy in (("drafter-datagen-worker", "datagen-s3"), ("ray-autoscaler-v1", "datagen-s3"),
                         ("ray-autoscaler-v1", "datagen-head"), ("drafter-datagen-pods", "datagen-s3")):
        assert re.search(rf"--role-name {role} --policy-name \S+ --policy-document file:///tmp/{policy}\.json", text)


def _list(x):
    return x if isinstance(x, list) else [x]


def test_gpu_workers_install_and_check_the_gpu_extra(cluster):
    """Issue 43: stage 2 on the hybrid target needs flash-linear-attention (the `gpu` extra) on every GPU node; the
    head does no GPU work and keeps the plain install."""
    import tomllib

    extras = tomllib.loads(open(os.path.join(ROOT, "pyproject.toml")).read())["project"]["optional-dependencies"]
    assert any(d.startswith("flash-linear-attention") for d in extras["gpu"])
    worker = " ; ".join(cluster["worker_setup_commands"])
    assert re.search(r"pip install .*-c /tmp/image-pins\.txt -e \"\$HOME/drafter-datagen\[gpu\]\"", worker), worker
    assert "import fla" in worker  # a worker without it fails its setup, not 10x slower mid-run
    # Every node type that has GPUs gets the worker setup (none overrides it); the head has none.
    for name, node in cluster["available_node_types"].items():
        if node["resources"].get("GPU"):
            assert "worker_setup_commands" not in node, name
    assert "[gpu]" not in " ".join(cluster["setup_commands"] + cluster["head_setup_commands"])


@pytest.mark.parametrize("cuda, fla, gdn, expected", [
    (True, True, "varlen", "Gated DeltaNet flash-linear-attention's varlen kernels, once per packed batch"),
    (True, False, "per_sequence", ">10x slower: flash-linear-attention is not installed"),
    (False, False, "per_sequence", "Gated DeltaNet transformers' torch reference (CPU)"),
])
def test_stage_2_names_its_kernel_path(cuda, fla, gdn, expected):
    from job.hidden_states.transformers_backend import describe_kernel_path

    line = describe_kernel_path(cuda=cuda, attention="packed" if cuda else "padded", gdn=gdn,
                                fuse="compile" if cuda else "off", hybrid=True, fla=fla)
    assert expected in line, line
    dense = describe_kernel_path(cuda=False, attention="padded", gdn="per_sequence", fuse="off", hybrid=False,
                                 fla=False)
    assert "Gated DeltaNet" not in dense and "attention padded" in dense
