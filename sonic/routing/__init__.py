"""Routers: top-K token choice and token rounding, and the routing metadata they feed (docs/design.md §2)."""

from sonic.routing.metadata import RoutingMetadata, routing_metadata
from sonic.routing.token_rounding import token_rounding_routing
from sonic.routing.topk import topk_routing
from sonic.routing.types import Routing

__all__ = ["Routing", "RoutingMetadata", "routing_metadata", "token_rounding_routing", "topk_routing"]
