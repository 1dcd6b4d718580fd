"""Captured sessions in the formats other tools read (pure; no store, no I/O).

``atif``: Harbor's Agent Trajectory Interchange Format, one trajectory per session, every sampled turn with its
token ids and logprobs. ``openai_jsonl``: plain OpenAI chat messages + tools, one example per chain, for SFT.
Both read a session's calls through the builder's chain reconstruction (``conversation.py``), so an export holds
the same chains `polar build` trains on.
"""

from polar_cli.export.atif import ATIF_VERSION, session_trajectory
from polar_cli.export.conversation import SessionChains, Turn, chain_turns, session_chains
from polar_cli.export.openai_jsonl import chain_example, session_examples

FORMATS = ("atif", "openai-jsonl")

__all__ = [
    "ATIF_VERSION",
    "FORMATS",
    "SessionChains",
    "Turn",
    "chain_example",
    "chain_turns",
    "session_chains",
    "session_examples",
    "session_trajectory",
]
