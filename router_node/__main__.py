import sys

from router_node.router import run_router_node

sys.exit(run_router_node())
