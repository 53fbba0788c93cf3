#!/bin/sh
# Entrypoint of the locoswarm image: `docker run IMAGE [ARGS]` is `locoswarm run [ARGS]`, with the same
# flags and LOCOSWARM_* environment variables (the image sets LOCOSWARM_STATE_DIR=/state, a volume,
# LOCOSWARM_HOST=0.0.0.0 and LOCOSWARM_CONTROL_PORT=7615).
#
#   docker run IMAGE --bootstrap /ip4/.../p2p/Qm...   locoswarm run --bootstrap ...
#   docker run IMAGE status --once                    another locoswarm command (run, status, config, ...)
#   docker run IMAGE locoswarm run --bootstrap ...    the same, as a node prints its join command
#   docker run IMAGE sh                               any other program
#
# LOCOSWARM_BOOTSTRAP_FROM=PATH (used by docker/compose.yaml): bootstrap from the node whose status.json
# is at PATH, e.g. that node's state volume mounted read-only; waits until that node is up
# (LOCOSWARM_BOOTSTRAP_WAIT seconds, default 300).
#
# As PID 1, locoswarm runs under docker/init.py (a minimal init: forwards signals, reaps orphans; a node
# cannot be PID 1 itself). SIGTERM (`docker stop`) and SIGINT make the node leave the swarm gracefully and
# checkpoint; give it time to finish in-flight rounds: `docker stop -t 60`.
set -eu

if [ "${1:-}" = locoswarm ]; then  # `docker run IMAGE locoswarm run ...`, as a node prints its join command
    shift
fi
case "${1:-}" in
    "" | -*) set -- run "$@" ;;
    run | status | config | partition | simulate | bench | plan | export) ;;
    *) exec "$@" ;;
esac

if [ "$1" = run ] && [ -n "${LOCOSWARM_BOOTSTRAP_FROM:-}" ]; then
    addr=$(/opt/venv/bin/python /opt/locoswarm/bootstrap_from.py "$LOCOSWARM_BOOTSTRAP_FROM")
    shift
    set -- run --bootstrap "$addr" "$@"
fi

if [ "$$" = 1 ]; then
    exec /opt/venv/bin/python /opt/locoswarm/init.py locoswarm "$@"
fi
exec locoswarm "$@"
