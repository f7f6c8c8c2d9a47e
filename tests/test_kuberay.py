"""deploy/kuberay/: the RayJob parses, its entrypoint is the command docs/OPERATIONS.md prints and the
job's parser accepts, no secret value is in it (job/redaction.py's detectors, and every secret-named variable comes
from a Secret), every container has the bucket's region, the GPU workers ask for GPUs, and the image installs the
`gpu` extra. What cannot be checked here (no Kubernetes cluster): that KubeRay runs it."""

from __future__ import annotations

import shlex

import pytest
import yaml
from conftest import REPO

from job import cli, redaction

RAYJOB = REPO / "deploy" / "kuberay" / "rayjob.yaml"
DOCKERFILE = REPO / "deploy" / "kuberay" / "Dockerfile"


@pytest.fixture(scope="module")
def rayjob() -> dict:
    docs = list(yaml.safe_load_all(RAYJOB.read_text()))
    assert len(docs) == 1
    return docs[0]


def _pod_specs(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    specs["submitter"] = rayjob["spec"]["submitterPodTemplate"]["spec"]
    return specs


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif value is not None:
        yield str(value)


def test_a_rayjob_whose_entrypoint_is_the_documented_command(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    entrypoint = rayjob["spec"]["entrypoint"]
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    assert f"-- {entrypoint}\n" in operations, "the entrypoint is not the command OPERATIONS submits"
    argv = shlex.split(entrypoint)
    assert argv[:3] == ["python", "-m", "job"]
    args = cli.build_parser().parse_args(argv[3:])
    assert args.command == "generate" and args.config == "configs/qwen3.6-27b.yaml"
    assert (REPO / args.config).exists()  # relative to the working directory the runtime_env ships
    assert yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["working_dir"] == "/home/ray/drafter-datagen"
    assert "WORKDIR /home/ray/drafter-datagen" in DOCKERFILE.read_text()


def test_no_secret_value_in_the_manifest(rayjob):
    for text in _strings(rayjob):
        assert redaction.redact_text(text) == text, f"a secret-shaped value in rayjob.yaml: {text!r}"
    assert "runtimeEnvYAML" in rayjob["spec"] and "env_vars" not in rayjob["spec"]["runtimeEnvYAML"]
    secret_vars = 0
    for name, spec in _pod_specs(rayjob).items():
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            for var in container.get("env", []):
                if redaction.is_secret_name(var["name"]):
                    secret_vars += 1
                    assert "value" not in var, (name, var)
                    assert var["valueFrom"]["secretKeyRef"]["name"] == "drafter-datagen-secrets", (name, var)
    assert secret_vars >= 3  # HF_TOKEN and an S3-compatible store's two keys, on each pod that runs the job


def test_every_node_gets_what_it_needs(rayjob):
    specs = _pod_specs(rayjob)
    for name in ("head", "gpu"):
        spec = specs[name]
        (container,) = spec["containers"]
        env = {v["name"]: v.get("value") for v in container["env"]}
        assert env["AWS_REGION"] == "us-west-2", name  # the bucket's region, as cluster.yaml's
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/mnt/local"}, name
        sync = " ".join(" ".join(c["command"]) for c in spec["initContainers"])
        assert "aws s3 sync" in sync and "/mnt/local/models/Qwen3.6-27B" in sync, name  # the config's model path
        assert spec["serviceAccountName"]  # S3 rights from the pods' IAM role, no keys
    gpu = specs["gpu"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpu) == 8
    assert "--exclude *.safetensors" in " ".join(specs["head"]["initContainers"][0]["command"])
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the driver only, as cluster.yaml's head
    images = {c["image"] for s in specs.values() for c in s["containers"]}
    assert len(images) == 1  # the submitter uploads the working_dir from the same image


def test_the_image_has_the_package_and_its_gpu_extra():
    import ray

    text = DOCKERFILE.read_text()
    assert f"FROM rayproject/ray-llm:{ray.__version__}-" in text  # cluster Ray == client Ray
    assert 'pip install -q -c /tmp/image-pins.txt -e "/home/ray/drafter-datagen[gpu]"' in text
    assert "import fla, vllm, job.generate, job.hidden_states" in text  # checked at build time
    rayjob_text = RAYJOB.read_text()
    assert f'rayVersion: "{ray.__version__}"' in rayjob_text


SERVICE_ACCOUNT = REPO / "deploy" / "kuberay" / "serviceaccount.yaml"


def test_token_auth_and_the_pods_iam_role_trusts_exactly_their_service_account(rayjob):
    """Ray's token auth on the cluster the RayJob makes (the head's dashboard listens on every interface); every pod
    runs as the service account serviceaccount.yaml makes, whose IRSA role OPERATIONS creates trusting that one
    account (namespace and name) and nothing else."""
    assert rayjob["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    account = yaml.safe_load(SERVICE_ACCOUNT.read_text())
    assert account["kind"] == "ServiceAccount"
    name, namespace = account["metadata"]["name"], account["metadata"]["namespace"]
    for pod, spec in _pod_specs(rayjob).items():
        if pod != "submitter":  # the submitter only talks to the head's job API: no S3
            assert spec["serviceAccountName"] == name, pod
    arn = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    role = arn.rsplit("/", 1)[1]
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    assert f'"$OIDC:sub": "system:serviceaccount:{namespace}:{name}"' in operations
    create = f"aws iam create-role --role-name {role} --assume-role-policy-document file:///tmp/pods-trust.json"
    s3 = f"aws iam put-role-policy --role-name {role} --policy-name s3 --policy-document file:///tmp/datagen-s3.json"
    assert create in operations and s3 in operations  # s3: step 1's policy, writes only under runs/


def test_the_other_steps_rayjobs_made_as_operations_says_run_commands_the_job_parses(tmp_path):
    """OPERATIONS' loop that makes stage 2's, worth's and train's RayJobs from rayjob.yaml, run as printed (its files
    put under tmp_path): each parses, has its own name, and its entrypoint is a command the job's parser accepts."""
    import subprocess

    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    start = operations.index('for step in "hidden-states:')
    loop = operations[start:operations.index("done\n", start) + len("done\n")].replace("/tmp/", f"{tmp_path}/")
    subprocess.run(["bash", "-euc", loop], cwd=REPO, check=True)
    made = {}
    for path in sorted(tmp_path.glob("rayjob-*.yaml")):
        (job,) = yaml.safe_load_all(path.read_text())
        argv = shlex.split(job["spec"]["entrypoint"])
        assert argv[:3] == ["python", "-m", "job"]
        made[job["metadata"]["name"]] = cli.build_parser().parse_args(argv[3:]).command
        assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    assert made == {"drafter-datagen-hidden-states": "hidden-states", "drafter-datagen-worth": "worth",
                    "drafter-datagen-train": "train"}
