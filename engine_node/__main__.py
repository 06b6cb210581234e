import sys

from engine_node.node import run_engine_node

sys.exit(run_engine_node())
