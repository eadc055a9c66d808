"""Adapters from what users already have: veRL tool config files, TRL-style environment classes, textarena games."""

from hybridflow.agents.adapters.textarena_env import TextArenaEnvironment
from hybridflow.agents.adapters.trl_env import TRLEnvironment, trl_environment_factory
from hybridflow.agents.adapters.verl_tools import ToolConfigError, VerlTool, load_verl_tool_config

__all__ = [
    "TRLEnvironment",
    "TextArenaEnvironment",
    "ToolConfigError",
    "VerlTool",
    "load_verl_tool_config",
    "trl_environment_factory",
]
