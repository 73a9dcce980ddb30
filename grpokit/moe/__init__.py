"""Mixture-of-Experts policies: their routers (``routers.py``), recording and replaying the experts they choose
(``recording.py``), and what a run does with them — the load-balancing loss, ``routing_replay``, the router metrics
(``training.py``). The formulas are in :mod:`grpokit.algorithms.routing`."""

from .recording import GenerationRoutes, RouteTap, recorded_forward
from .routers import Router, RouterSet, find_routers, has_routers
from .training import ROUTING_REPLAY_MODES, MoeRouting, router_aux_loss_coef

__all__ = ["ROUTING_REPLAY_MODES", "GenerationRoutes", "MoeRouting", "RouteTap", "Router", "RouterSet", "find_routers",
           "has_routers", "recorded_forward", "router_aux_loss_coef"]
