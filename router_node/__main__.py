import sys

from router_node.main import run_router_node

sys.exit(run_router_node())
