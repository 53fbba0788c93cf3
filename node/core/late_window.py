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

At the end of the window the wait is bounded (:func:`stall_budget`): as long again as the window lasted in
wall time, at least ``MIN_STALL_S``. A round still running then is left in flight: training goes on, it is
merged when it lands, and its fragment's next sync waits for it. The wait is the link's backpressure when
rounds are a little slower than the window; without the bound, a member that entered a round and then
crawled (a peer starved of CPU, a hostile one) stalled every other member of its group until the round
timeout (robustness bench, ``values x2``: an honest node made one inner step in 17 s).

No torch here: the planner models the same window (``locoswarm.node.plan``).
"""

from __future__ import annotations

AUTO = -1
MIN_STALL_S = 1.0  # the least a round at the end of its late window is waited for (seconds)


def has_late_window(*, merges_late: bool, max_delay: int) -> bool:
    """Whether rounds slower than tau are merged late (else the node waits at tau, like blocking DiLoCo)."""
    return merges_late and max_delay != 0


def late_window(*, h: int, fragments: int, tau: int, max_delay: int = AUTO, merges_late: bool = True) -> int:
    """Inner steps after a send at which the node waits for the round if it has not finished."""
    if not has_late_window(merges_late=merges_late, max_delay=max_delay):
        return tau
    window = h // fragments if max_delay == AUTO else max_delay
    return min(max(tau, window), max(tau, h))


def stall_budget(window_s: float) -> float:
    """Seconds a round still running at the end of its late window is waited for: as long again as the window
    lasted (``window_s``, wall time from the send), at least ``MIN_STALL_S``."""
    return max(MIN_STALL_S, window_s)
