"""The Kubernetes manifest in docs/ starts each server with flags the command accepts."""

from __future__ import annotations

import pathlib

import yaml

from pathways_nb.cli import build_parser

MANIFEST = pathlib.Path(__file__).resolve().parent.parent / "docs" / "kubernetes" / "pathways-nb.yaml"


def test_manifest_containers_use_valid_flags():
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    jobset = next(d for d in documents if d["kind"] == "JobSet")
    commands = []
    for job in jobset["spec"]["replicatedJobs"]:
        for container in job["template"]["spec"]["template"]["spec"]["containers"]:
            args = build_parser().parse_args(container["args"])
            commands.append(args.command)
    assert sorted(commands) == ["proxy", "resource-manager", "worker", "worker"]
