"""Multi-turn rollouts: tools, environments and the loop that runs them (TRL 1.16's ``tools=`` and
``environment_factory=``).

- :mod:`.parsing`: tool calls in the formats chat templates ask for;
- :mod:`.execution`: running a batch's calls, errors becoming tool messages;
- :mod:`.templates`: template checks, the tokens of a tool turn, a tool-capable ChatML template;
- :mod:`.loop`: generate → call tools → append → generate, with the tool mask;
- :mod:`.environments`: one environment per rollout; :mod:`.session`: what the trainer uses.
"""

from .environments import Environments, reset_prompt
from .loop import ToolRollouts, run_tool_loop
from .parsing import STYLES, ParsedTurn, detect_style, parse_turn
from .session import MultiTurn, TurnLimits, check_tools
from .templates import CHATML_TOOLS_TEMPLATE, ToolTurnTokens, supports_tool_calls

__all__ = ["CHATML_TOOLS_TEMPLATE", "STYLES", "Environments", "MultiTurn", "ParsedTurn", "ToolRollouts",
           "ToolTurnTokens", "TurnLimits", "check_tools", "detect_style", "parse_turn", "reset_prompt", "run_tool_loop",
           "supports_tool_calls"]
