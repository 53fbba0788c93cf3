"""The outer loop of the four papers, in pure torch (no networking).

One home per mechanism:
- ``codecs``          payload codecs fp32/bf16/int8/fp4 (E3M0) and error feedback
- ``state``           per-fragment outer state (phi, momentum, residual, snapshot, version)
- ``outer_optimizer`` the Nesterov outer step (DiLoCo)
- ``merge``           how a sync result is merged into live params: replace, alpha, rebase,
                      compensate (CoCoDC), eager
- ``schedule``        which fragment syncs when: fixed offsets (Streaming DiLoCo), adaptive (CoCoDC)
- ``outer_loop``      ``OuterLoop``: one worker's driver of the above over a ``Transport``
"""
