"""Deploying a pathways-nb cluster: ``pathways-nb deploy k8s`` writes Kubernetes manifests and a Dockerfile,
``pathways-nb deploy slurm`` a Slurm batch script (``pathways_nb.deploy.slurm``).

>>> from pathways_nb.deploy import Deployment, accelerator, write_kubernetes   # doctest: +SKIP
>>> write_kubernetes(Deployment(2, 1, 4, accelerator("cpu"), image="pathways-nb:0.1.0"), "k8s/")   # doctest: +SKIP
"""

from pathways_nb.deploy.accelerators import ACCELERATORS, Accelerator, accelerator
from pathways_nb.deploy.kubernetes import Deployment
from pathways_nb.deploy.kubernetes import write as write_kubernetes

__all__ = ["ACCELERATORS", "Accelerator", "Deployment", "accelerator", "write_kubernetes"]
