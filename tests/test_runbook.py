"""The runbook's commands are the ones that run (issue 43): what docs/OPERATIONS.md says `make submit`, `make up` and
`make down` expand to is what the Makefile expands them to (`make -n`); every `make submit` line of the README and
OPERATIONS is one of those; every `python -m job ...` command of the runbook parses with the job's own parser; and
the command outputs the docs print (the plans) are what the commands print now (docs/regenerate.py).
Fast: `make -n` and argparse only, and two `plan` subprocesses."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

from job import cli

OPERATIONS = (REPO / "docs" / "OPERATIONS.md").read_text()
README = (REPO / "README.md").read_text()
# The docs' shell variables, given values so that make (which would expand `$OUTPUT` itself) sees what a shell passes.
VALUES = {"$BUCKET": "my-team-datagen", "$OUTPUT": "s3://my-team-datagen/runs/qwen3.6-27b-v1"}


def _concrete(text: str) -> str:
    for name, value in VALUES.items():
        text = text.replace(name, value)
    return text


def _expansion_table() -> list[tuple[str, str]]:
    """(make command, its expansion) rows of OPERATIONS' "What `make submit` runs" table."""
    rows = re.findall(r"^\| `(make [^`]+)` \| `([^`]+)` \|$", OPERATIONS, re.M)
    assert len(rows) >= 5, rows
    return rows


def _make_n(command: str) -> str:
    # -o: the install stamp counts as up to date, so only the target's own recipe is printed.
    argv = ["make", "-n", "-o", ".venv/.installed", *shlex.split(_concrete(command))[1:]]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.replace("\\\n", " ").split())


@pytest.mark.parametrize("command, expansion", _expansion_table())
def test_make_expands_to_what_the_docs_print(command, expansion):
    assert " ".join(_concrete(expansion).split()) in _make_n(command)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S)


def _commands(text: str, prefix: str) -> list[str]:
    """Every line of the text's bash blocks that starts with `prefix` (after an optional `$ `), its comment cut."""
    out = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith(prefix):
                out.append(" ".join(line.split("  #")[0].split()))
    return out


def test_every_make_submit_the_docs_print_is_in_the_table():
    table = {" ".join(c.split()) for c, _ in _expansion_table()}
    printed = _commands(OPERATIONS, "make submit") + _commands(README, "make submit")
    assert len(printed) >= 6, printed
    for command in printed:
        assert command in table, f"{command!r} is printed but not in OPERATIONS' expansion table"
    assert any("STAGE=hidden-states" in c for c in _commands(README, "make submit")), "README: no stage 2 step"


def test_make_submit_refuses_what_it_cannot_run():
    for args, message in ((["STAGE=export"], "generate (stage 1) or hidden-states (stage 2)"),
                          (["STAGE=hidden-states", "INPUT=s3://b/p/"], "INPUT is stage 1's")):
        proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", "submit", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_the_runbooks_job_commands_parse():
    """Every `python -m job ...` of the runbook (OPERATIONS' whole-way block and the README's cluster section, the
    `ray job submit ... -- python -m job ...` entrypoints included) is accepted by the job's own parser."""
    whole_way = OPERATIONS[OPERATIONS.index("## The whole way, in commands"):OPERATIONS.index("## What each step")]
    cluster = README[README.index("## Running on a cluster"):README.index("## The target is a hybrid model")]
    commands = []
    for text in (whole_way, cluster):
        for line in _commands(text, "") + [e for _, e in _expansion_table()]:
            if "python -m job " in line:
                commands.append(line.split("python -m job ", 1)[1])
    assert len(commands) >= 8, commands
    parser = cli.build_parser()
    for command in commands:
        args = shlex.split(_concrete(command.split(" #")[0]))
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"`python -m job {command}` does not parse")
    stages = {shlex.split(c)[0] for c in commands}
    assert {"plan", "generate", "hidden-states", "status", "train"} <= stages, stages


def _policy_write_prefixes() -> list[str]:
    """The bucket prefixes the documented S3 policy (OPERATIONS step 1) lets the cluster write: the Resource of its
    s3:PutObject statement."""
    block = OPERATIONS[OPERATIONS.index("cat > /tmp/datagen-s3.json"):]
    block = block[:block.index("\nJSON")]
    statement = next(st for st in re.findall(r"\{[^{}]*\}", block) if "s3:PutObject" in st)
    prefixes = re.findall(r"arn:aws:s3:::\$BUCKET/([^\"*]*)\*", statement)
    assert prefixes, statement
    return prefixes


def _written_uris(text: str) -> list[str]:
    """The S3 URIs the documented commands of `text` write: --output, --checkpoints, OUTPUT=, and the drafts that
    `train RUN` leaves under the run."""
    uris = re.findall(r"(?:--output|--checkpoints|--storage-path)\s+(s3://\S+|\$OUTPUT\S*)", text)
    uris += re.findall(r"^OUTPUT=(\S+)", text, re.M)
    uris += [f"{run}/drafts/" for run in re.findall(r"python -m job train (s3://\S+|\$OUTPUT)\b", text)]
    return uris


def test_every_output_the_docs_name_is_writable_under_the_documented_policy():
    """A command the docs print writes only where the documented S3 policy lets the cluster write: caught here, not
    by AccessDenied at the end of a 40-hour run."""
    prefixes = _policy_write_prefixes()
    uris = [_concrete(u).rstrip("`'\".,;)") for u in _written_uris(OPERATIONS) + _written_uris(README)]
    assert len(uris) >= 6, uris
    keys = [u.split("/", 3)[3] if u.count("/") >= 3 else "" for u in uris if u.startswith("s3://")]
    denied = [u for u, key in zip([u for u in uris if u.startswith("s3://")], keys)
              if not any(key.startswith(p) for p in prefixes)]
    assert not denied, f"outputs the documented policy (writes under {prefixes}) denies: {denied}"


def test_the_docs_printed_outputs_are_the_commands_output():
    """docs/regenerate.py's blocks (the plans in OPERATIONS): a figure the docs print is the command's own. After a
    change, `.venv/bin/python docs/regenerate.py` rewrites them."""
    spec = importlib.util.spec_from_file_location("regenerate", REPO / "docs" / "regenerate.py")
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)
    assert regenerate.MARKER in OPERATIONS
    for path in regenerate.DOCS:
        assert regenerate.diff(path) == "", f"{path} is stale: run `.venv/bin/python docs/regenerate.py`\n" + \
            regenerate.diff(path)


def test_the_figures_the_docs_repeat_are_the_plans():
    """README's and OPERATIONS' cost table repeat the plan's figures in round numbers: they are its, rounded."""
    import json

    def plan(*flags: str) -> dict:
        argv = ["plan", "--config", "configs/qwen3.6-27b.yaml", "--prompts", "914000", "--tokens-per-prompt", "2500",
                "--tokens-per-s-per-gpu", "2000", "--usd-per-gpu-hour", "3.81", *flags, "--json"]
        proc = subprocess.run([sys.executable, "-m", "job", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    on8, on7 = plan("--gpus", "8"), plan("--gpus", "7")
    ways = on8["hidden_state_ways"]
    bf16_tb, fp8_tb = ways["stored_bf16"]["bytes"] / 1e12, ways["stored_fp8"]["bytes"] / 1e12
    cluster = README[README.index("## Running on a cluster"):README.index("## The target is a hybrid model")]
    assert f"≈{on8['hours']:.0f} h, ≈${round(on8['cost_usd'], -1):,.0f} on 8 GPUs" in cluster
    assert f"stored in bf16 (~{bf16_tb:.0f} TB for the completions' tokens;" in cluster
    assert f"(~{on8['train_gpu_hours']:.0f}\nGPU-hours an epoch at one H100's measured rate" in cluster
    row = next(line for line in OPERATIONS.splitlines() if line.startswith("| full run, 914K prompts"))
    assert f"~{on8['hours']:.0f} h on 8 GPUs ({on7['hours']:.0f} h on 7)" in row
    assert f"~${round(on8['cost_usd'], -1):,.0f}" in row
    row = next(line for line in OPERATIONS.splitlines() if line.startswith("| keeping outputs in S3"))
    month = on8["hidden_state_usd_per_month"]
    assert f"hidden states ~{bf16_tb:.0f} TB ≈ ${round(month, -2):,.0f}/month" in row
    assert f"FP8: ~{fp8_tb:.0f} TB ≈ ${round(ways['stored_fp8']['storage_usd'], -2):,.0f}" in row
    assert f"completions ~{on8['completion_bytes'] / 1e9:.0f} GB" in row
    # The S3 requests of writing the run: the object counts and the bill, as plan counts them.
    writes = " ".join(OPERATIONS[OPERATIONS.index("**S3 requests of the bookkeeping**"):
                                 OPERATIONS.index("Plan before renting anything")].split())
    assert f"{on8['completion_shards']:,} completion shards" in writes
    assert f"{on8['stage2_parts'] / 1e3:.1f}K stage-2 parts" in writes
    assert f"up to ~{on8['write_requests'] / 1e3:.1f}K requests, ${on8['write_requests_usd']:.2f}" in writes


def test_the_figures_the_makefile_and_readme_repeat_agree():
    """The install's size (README, Makefile) and the acceptance benchmark's times (Makefile, BENCHMARKS) are stated
    in two places each: the same figure in both."""
    import re

    makefile = (REPO / "Makefile").read_text()
    benchmarks = (REPO / "docs" / "BENCHMARKS.md").read_text()
    size = re.search(r"~(\d+) GB \([\d.]+ GB measured\)", makefile).group(1)
    assert f"`.venv/`, ~{size} GB" in README
    for minutes in re.findall(r"(\d+\.\d) min (?:measured in a fresh clone|here \(docs/BENCHMARKS)", makefile):
        assert f"{minutes} min" in benchmarks, minutes
