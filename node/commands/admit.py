"""``locoswarm admit``: the keys and certificates of a closed swarm (``locoswarm.node.swarm.admission``).

    locoswarm admit keygen --out owner.key             # once, by the swarm's owner: prints owner_key = "..."
    locoswarm admit peer-id --state-dir ~/.locoswarm   # on each node: its peer id (made if it has none yet)
    locoswarm admit sign --key owner.key --swarm NAME --peer-id Qm... --days 90 --out node.cert
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text

MAX_DAYS = 3650


def _keygen(args: argparse.Namespace) -> int:
    # lazy: swarm.admission loads cryptography (~15 ms at every CLI start, measured)
    from locoswarm.node.swarm.admission import new_owner_key

    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"--out {out} exists; pass --force to replace it (the swarm's certificates then need "
                        "signing anew)")
    pem, public = new_owner_key()
    atomic_write_text(out, pem.decode())
    os.chmod(out, 0o600)
    print(f"wrote the owner's private key to {out} (keep it secret). Put this in the swarm's peers.toml:")
    print(f'[swarm]\nowner_key = "{public}"')
    return 0


def _peer_id(args: argparse.Namespace) -> int:
    # lazy: swarm.records imports hivemind (~0.35 s at every CLI start, measured)
    from locoswarm.node.swarm.records import identity_key, peer_id_of

    key = identity_key(Path(args.state_dir) / "identity.key")
    print(peer_id_of(key.get_public_key()))
    return 0


def _sign(args: argparse.Namespace) -> int:
    # lazy: swarm.admission loads cryptography (~15 ms at every CLI start, measured)
    from locoswarm.node.swarm.admission import AdmissionError, load_private_key, sign

    if not 0 < args.days <= MAX_DAYS:
        raise UserError(f"--days {args.days} is not allowed; use 1..{MAX_DAYS}")
    if not args.peer_id.startswith("Qm") or len(args.peer_id) > 128:
        raise UserError(f"--peer-id {args.peer_id[:60]!r} is not a libp2p peer id; get a node's with "
                        "'locoswarm admit peer-id --state-dir DIR'")
    try:
        owner = load_private_key(Path(args.key).read_bytes())
    except OSError as exc:
        raise UserError(f"--key {args.key}: {exc.strerror or exc}") from None
    except AdmissionError as exc:
        raise UserError(f"--key {args.key}: {exc}") from None
    cert = sign(owner, args.peer_id, args.swarm, int(time.time() + args.days * 86400))
    atomic_write_text(Path(args.out), cert.to_bytes().decode())
    print(f"wrote {args.out}: peer {args.peer_id} may join swarm {args.swarm!r} for {args.days} days; on that "
          f"node set [swarm] certificate = \"{args.out}\" (or --set swarm.certificate={args.out})")
    return 0


def register(sub) -> None:
    """Add the ``admit`` subcommand (closed swarms)."""
    parser = sub.add_parser("admit", help="keys and certificates of a closed swarm",
                            description="A closed swarm admits only nodes holding a certificate signed with its "
                                        "owner's key ([swarm] owner_key, certificate).")
    cmds = parser.add_subparsers(dest="admit_command", required=True, metavar="ACTION")
    p = cmds.add_parser("keygen", help="make the owner's key pair")
    p.add_argument("--out", required=True, help="where to write the private key (PEM, mode 600)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(func=_keygen)
    p = cmds.add_parser("peer-id", help="print a node's peer id (its identity is made if it has none yet)")
    p.add_argument("--state-dir", required=True, help="the node's state directory")
    p.set_defaults(func=_peer_id)
    p = cmds.add_parser("sign", help="sign a node's certificate")
    p.add_argument("--key", required=True, help="the owner's private key (from keygen)")
    p.add_argument("--swarm", required=True, help="the swarm's name ([swarm] name)")
    p.add_argument("--peer-id", required=True, help="the node's peer id (from peer-id)")
    p.add_argument("--days", type=int, default=90, help="how long it is valid (default 90)")
    p.add_argument("--out", required=True, help="where to write the certificate")
    p.set_defaults(func=_sign)
