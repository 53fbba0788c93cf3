"""``locoswarm bench swarm``: real nodes in network namespaces on shaped links, several configurations
side by side, a report of compute utilization against the unshaped ceiling and the planner.

Modules: :mod:`.spec` (flags, configurations), :mod:`.netns` (namespaces, veths, bridge, tc, iptables),
:mod:`.proxy` (user-space latency proxy), :mod:`.runner` (one configuration's peers and measurement),
:mod:`.report` (results.json, report.md, swarm.png), :mod:`.cli` (the command), :mod:`.peers` (the
``hivemind`` configuration's peer program).
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    # lazy: circle (.cli imports .spec from this package); the peer and proxy programs skip ~17 ms (measured)
    from locoswarm.node.bench.swarm.cli import register as _register

    _register(sub)
