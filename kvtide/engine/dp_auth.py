"""Who may join a multi-node data-parallel deployment: a node that holds its shared secret.

The head's rendezvous (--data-parallel-rpc-port) hands a joining replica the addresses where it
receives prompts; anyone it welcomed would get a share of every user's requests. So a join is a
challenge-response under the secret (dp_remote.py), both ways (the head proves it holds the secret
too), and the data connections it sets up are CURVE-encrypted and accept only the key the joiner
presented inside its authenticated answer.

Where the secret comes from: $KVTIDE_DP_SECRET, the same value on the head and on every headless
node. An environment variable, like the p2p connector's $KVTIDE_KV_SECRET: it never appears on a
command line (`ps`), child processes inherit it, and Kubernetes sets it from a Secret. Without
it, a deployment whose rendezvous is on a loopback address (all of its nodes on one machine:
tests, trying it out) uses a per-user secret file, $KVTIDE_CACHE/dp-secret (mode 0600, made on
first use, as ~/.erlang.cookie is): the same user's processes share it, other users cannot read
it. Over any other address, starting without the secret is refused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from kvtide.net_auth import is_loopback, sign

SECRET_ENV = "KVTIDE_DP_SECRET"
COOKIE_NAME = "dp-secret"
"""The loopback deployments' per-user secret, in $KVTIDE_CACHE."""


def data_parallel_secret(host: str) -> bytes:
    """The deployment's secret for a rendezvous at `host`; ValueError when there is none to use."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    if not is_loopback(host):
        raise ValueError(f"multi-node data parallelism over {host} needs a shared secret: set ${SECRET_ENV} to the "
                         f"same value on the head and on every headless node (joins at --data-parallel-rpc-port "
                         f"and the replicas' data connections are authenticated with it), e.g. "
                         f"`export {SECRET_ENV}=$(openssl rand -hex 32)`")
    return loopback_cookie()


def loopback_cookie(directory: str | None = None) -> bytes:
    """This user's secret file in `directory` ($KVTIDE_CACHE), made on first use (atomically: two
    processes starting together read the same one); refused when others could read or replace it."""
    # $KVTIDE_CACHE as kvtide.models.cache_dir.cache_root() reads it (engine code imports no models package)
    directory = directory or os.environ.get("KVTIDE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "kvtide"))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, COOKIE_NAME)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # fails if another process made it first: theirs is kept
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"{path} must be a regular file of this user's, readable by no one else (mode 0600): "
                         f"remove it, or set ${SECRET_ENV}")
    with open(path) as f:
        value = f.read().strip()
    if not value:
        raise ValueError(f"{path} is empty: remove it, or set ${SECRET_ENV}")
    return value.encode()


# ---- the join's MACs (dp_remote.py) -----------------------------------------------------------------
def head_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The head's answer to a hello: it holds the secret (a joiner never serves a stranger)."""
    return sign(secret, b"dp-head", client_nonce, server_nonce)


def join_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes, rank: int, size: int, node: str,
             client_key: bytes) -> bytes:
    """The joiner's answer: it holds the secret, for this rank, with this CURVE key."""
    return sign(secret, b"dp-join", client_nonce, server_nonce, str(rank).encode(), str(size).encode(),
                node.encode(), client_key)


def welcome_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes, input_addr: str, output_addr: str,
                expert_group: str | None, server_key: bytes) -> bytes:
    """The head's welcome: these addresses and this server key are the head's, not a forwarder's."""
    return sign(secret, b"dp-welcome", client_nonce, server_nonce, input_addr.encode(), output_addr.encode(),
                (expert_group or "").encode(), server_key)
