"""Pydantic models for Agent Trajectory Interchange Format (ATIF).

This module provides Pydantic models for validating and constructing
trajectory data following the ATIF specification (RFC 0001).
"""

from tests.support.harbor_atif.agent import Agent
from tests.support.harbor_atif.content import (
    AudioSource,
    ContentPart,
    ImageSource,
)
from tests.support.harbor_atif.final_metrics import FinalMetrics
from tests.support.harbor_atif.metrics import Metrics
from tests.support.harbor_atif.observation import Observation
from tests.support.harbor_atif.observation_result import ObservationResult
from tests.support.harbor_atif.step import Step
from tests.support.harbor_atif.subagent_trajectory_ref import SubagentTrajectoryRef
from tests.support.harbor_atif.tool_call import ToolCall
from tests.support.harbor_atif.trajectory import Trajectory

__all__ = [
    "Agent",
    "AudioSource",
    "ContentPart",
    "FinalMetrics",
    "ImageSource",
    "Metrics",
    "Observation",
    "ObservationResult",
    "Step",
    "SubagentTrajectoryRef",
    "ToolCall",
    "Trajectory",
]
