"""Agentic rollouts: multi-turn episodes with tools and environments, kept token-in/token-out.

Knows nothing of Ray: ``AgentLoop`` drives a ``Generator`` (any rollout engine that can continue a list of token ids)
over rows; ``collate_episodes`` turns the finished episodes into a DataProto for the trainer. See docs/agents.md.
"""

from hybridflow.agents.collate import collate_episodes
from hybridflow.agents.engine_generator import RolloutEngineGenerator
from hybridflow.agents.environment import Environment, EnvStep
from hybridflow.agents.generator import Generation, Generator, HFGenerator
from hybridflow.agents.loop import AgentFailureError, AgentLoop, AgentLoopConfig, Episode, summarize_episodes
from hybridflow.agents.parsers import HermesToolParser, ToolCall, get_parser, register_parser
from hybridflow.agents.schema import check_arguments, function_schema
from hybridflow.agents.tools import FunctionTool, Tool, ToolResult, as_tool
from hybridflow.agents.trajectory import ChatRenderer, Trajectory

__all__ = [
    "AgentFailureError",
    "AgentLoop",
    "AgentLoopConfig",
    "ChatRenderer",
    "EnvStep",
    "Environment",
    "Episode",
    "FunctionTool",
    "Generation",
    "Generator",
    "HFGenerator",
    "HermesToolParser",
    "RolloutEngineGenerator",
    "Tool",
    "ToolCall",
    "ToolResult",
    "Trajectory",
    "as_tool",
    "check_arguments",
    "collate_episodes",
    "function_schema",
    "get_parser",
    "register_parser",
    "summarize_episodes",
]
