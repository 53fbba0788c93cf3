"""How long a node trains on before it waits for a sync that is slower than its overlap tau.

Streaming DiLoCo merges a fragment's result exactly tau inner steps after its send; a round that takes
longer stalls training until it finishes. On a slow link that stall is the whole cost of a round. A
node here waits only at the end of its *late window*: past tau, a round still running is merged when
it lands, while training goes on. That is sound only for merge rules that keep the local progress made
since the send (alpha mixes it, rebase carries it, CoCoDC compensates it); ``replace`` resets theta to
phi and would drop those steps, so it waits at tau like blocking DiLoCo. The eager and naive-delay
rules already overlap a whole round (tau = h).

The window ends at the latest h steps after the send, so a fragment's next sync never overtakes its
last; auto (``max_delay = -1``) is h / fragments, the spacing of the schedule's sync events.

No torch here: the planner models the same window (``locoswarm.node.plan``).
"""

from __future__ import annotations

AUTO = -1


def late_window(*, h: int, fragments: int, tau: int, max_delay: int = AUTO, merges_late: bool = True) -> int:
    """Inner steps after a send at which the node waits for the round if it has not finished."""
    if not merges_late or max_delay == 0:
        return tau
    window = h // fragments if max_delay == AUTO else max_delay
    return min(max(tau, window), max(tau, h))
