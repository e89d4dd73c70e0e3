"""Deploying a pathways-nb cluster: ``pathways-nb deploy k8s`` writes Kubernetes manifests and a Dockerfile,
``pathways-nb deploy slurm`` a Slurm batch script (``pathways_nb.deploy.slurm``).

>>> from pathways_nb.deploy import Deployment, accelerator, write_kubernetes   # doctest: +SKIP
>>> write_kubernetes(Deployment(2, 1, 4, accelerator("cpu"), image="pathways-nb:0.1.0"), "k8s/")   # doctest: +SKIP
"""

import argparse

from pathways_nb.deploy import kubernetes, slurm
from pathways_nb.deploy.accelerators import ACCELERATORS, Accelerator, accelerator
from pathways_nb.deploy.kubernetes import Deployment
from pathways_nb.deploy.kubernetes import write as write_kubernetes

__all__ = ["ACCELERATORS", "Accelerator", "Deployment", "accelerator", "add_parser", "write_kubernetes"]


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``deploy`` commands (``k8s``, ``slurm``), among ``commands``; ``common``: every command's flags."""
    deploy = commands.add_parser("deploy", parents=[common], help="write what runs a cluster on other machines")
    targets = deploy.add_subparsers(dest="deploy_target", required=True)
    kubernetes.add_parser(targets, common)
    slurm.add_parser(targets, common)
