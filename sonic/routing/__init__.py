"""Routers: top-K token choice and token rounding, and the routing metadata they feed (docs/design.md §2)."""

from sonic.routing.losses import router_z_loss, sequence_balance_loss
from sonic.routing.metadata import RoutingMetadata, routing_metadata
from sonic.routing.token_rounding import token_rounding_routing
from sonic.routing.topk import topk_routing
from sonic.routing.types import Routing

__all__ = ["Routing", "RoutingMetadata", "router_z_loss", "routing_metadata",
           "sequence_balance_loss", "token_rounding_routing", "topk_routing"]
