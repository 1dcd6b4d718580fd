"""Tests start mitmdump the way users' rollouts do."""

from polar_cli.mitm import REPO, Proxy, free_port, run_mitmdump, wait_for_port

__all__ = ["REPO", "Proxy", "free_port", "run_mitmdump", "wait_for_port"]
