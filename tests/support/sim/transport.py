"""The simulated NCCL between processes (``Sim(transport="processes")``): a hub in the process that made the unique
id, and each communicator's connection to it.

The unique id names the hub (``MAGIC``, kind 1, port, authentication key, group token). A communicator joins (its
``ncclCommInitRank`` returns once every rank joined); when one of its kernels reaches a call, it sends the call and its
send buffer's bytes to the hub; once every rank of the call has arrived, the hub checks that they agree (else every
rank's kernel fails with the mismatch named, as in process), computes the results in rank order (every rank gets the
same bits) and sends each rank its receive buffer's bytes and the call's virtual start. An abort withdraws the rank's
arrivals (a call it left never completes) and is told to the others, as is a process that dies (its connection
closes): each survivor then sees ``ncclRemoteError`` where its sim has ``abort_reaches_peers`` (a network), and spins
until its own abort otherwise (NVLink). The data moves on the hub's and the connections' threads; the kernels' worker
threads only wait, as a spinning kernel does."""

from __future__ import annotations

import secrets
import struct
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from tests.support.sim import nccl as sim_nccl

_HOST = "127.0.0.1"


def _encode(port: int, authkey: bytes, token: bytes) -> bytes:
    body = sim_nccl.MAGIC + b"\x01" + struct.pack(">H", port) + authkey + token
    return body.ljust(sim_nccl.UNIQUE_ID_BYTES, b"\0")


def _decode(uid: bytes) -> tuple[int, bytes, bytes]:
    at = len(sim_nccl.MAGIC) + 1
    (port,) = struct.unpack(">H", uid[at:at + 2])
    return port, uid[at + 2:at + 18], uid[at + 18:at + 34]


class _HubPost:
    """A rank's arrival at the hub, as ``sim_nccl._execute`` reads one."""

    def __init__(self, rank: int, call: sim_nccl.Call, send: bytes | None, recv_nbytes: int) -> None:
        self.member = type("_Rank", (), {"rank": rank})()
        self.call = call
        self.send = None if send is None else torch.frombuffer(bytearray(send), dtype=torch.uint8)
        self.recv = torch.zeros(recv_nbytes, dtype=torch.uint8) if recv_nbytes else None

    def view(self, which: str) -> torch.Tensor:
        data = self.send if which == "send" else self.recv
        return data.view(sim_nccl.TORCH_DTYPES[self.call.dtype])


class Hub:
    """Serves every group whose unique id this process made."""

    def __init__(self, nccl: Any) -> None:
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener((_HOST, 0), authkey=self._authkey)
        self._lock = threading.Lock()
        self._groups: dict[bytes, dict[str, Any]] = {}  # token -> {"nranks", "conns", "arrivals", "gone"}
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="sim-nccl-hub")
        self._thread._sim_unbound = True  # type: ignore[attr-defined]
        self._thread.start()

    def unique_id(self) -> bytes:
        return _encode(self._listener.address[1], self._authkey, secrets.token_bytes(16))

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                return
            reader = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="sim-nccl-hub-conn")
            reader._sim_unbound = True  # type: ignore[attr-defined]
            reader.start()

    def _serve(self, conn: Connection) -> None:
        token, rank = None, None
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "join":
                    _, token, rank, nranks = message
                    self._join(token, rank, nranks, conn)
                elif kind == "arrive":
                    self._arrive(token, rank, *message[1:])
                elif kind == "abort":
                    self._gone(token, rank, "aborted")
                elif kind == "leave":
                    self._gone(token, rank, "left")
                    return
        except (EOFError, OSError):
            if token is not None:
                self._gone(token, rank, "died")

    def _send(self, conn: Connection, message: tuple[Any, ...]) -> None:
        try:
            conn.send(message)
        except (OSError, EOFError):
            pass

    def _join(self, token: bytes, rank: int, nranks: int, conn: Connection) -> None:
        with self._lock:
            group = self._groups.setdefault(token, {"nranks": nranks, "conns": {}, "arrivals": {}, "gone": {}})
            group["conns"][rank] = conn
            ready = len(group["conns"]) == nranks
            conns = list(group["conns"].values())
        if ready:
            for c in conns:
                self._send(c, ("ready",))

    def _arrive(self, token: bytes, rank: int, key: tuple[Any, ...], expected: tuple[int, ...],
                call: sim_nccl.Call, send: bytes | None, recv_nbytes: int, time: float) -> None:
        with self._lock:
            group = self._groups[token]
            if rank in group["gone"]:
                return
            arrivals = group["arrivals"].setdefault(key, {})
            arrivals[rank] = (call, send, recv_nbytes, time)
            if set(arrivals) != set(expected):
                return
            del group["arrivals"][key]
            conns = dict(group["conns"])
        calls = {r: a[0] for r, a in arrivals.items()}
        agree = len({c.matched_as for c in calls.values()}) == 1
        if agree and key[0] == "p2p":
            src, dst = key[1], key[2]
            agree = calls[src].kind == "send" and calls[dst].kind == "recv" and calls[src].arg == dst and \
                calls[dst].arg == src
        if not agree:
            what = (f"call #{key[1] + 1}" if key[0] == "coll" else
                    f"send #{key[3] + 1} from rank {key[1]} to rank {key[2]}")
            text = (f"{what} on a communicator of {len(conns)} ranks (processes) differs across ranks: "
                    + "; ".join(f"rank {r}: {calls[r]}" for r in sorted(calls)))
            for r in expected:
                self._send(conns[r], ("failed", key, text))
            return
        posts = [_HubPost(r, *arrivals[r][:3]) for r in sorted(arrivals)]
        sim_nccl._execute(posts)
        start = max(a[3] for a in arrivals.values())
        for post in posts:
            out = None if post.recv is None else post.recv.numpy().tobytes()
            self._send(conns[post.member.rank], ("done", key, out, start))

    def _gone(self, token: bytes, rank: int, how: str) -> None:
        with self._lock:
            group = self._groups.get(token)
            if group is None:
                return
            group["gone"][rank] = how
            for arrivals in group["arrivals"].values():
                arrivals.pop(rank, None)  # a call it left never completes
            conns = [c for r, c in group["conns"].items() if r != rank and r not in group["gone"]]
        if how != "left":
            for c in conns:
                self._send(c, ("peer", rank, how))


class RemoteGroup:
    """A communicator's group in another process's hub: what ``sim_nccl`` asks of an in-process ``Group``."""

    def __init__(self, nccl: Any, uid: bytes, nranks: int) -> None:
        self.nccl = nccl
        self.uid = uid
        self.nranks = nranks
        port, authkey, self.token = _decode(uid)
        self.label = f"communicator {self.token[:3].hex()} ({nranks} ranks, processes)"
        self.delay_s = 0.0
        self.matches: dict[tuple[Any, ...], sim_nccl.Match] = {}
        self.members: dict[int, Any] = {}
        self._conn = Client((_HOST, port), authkey=authkey)
        self._send_lock = threading.Lock()
        self._ready = False
        self._member: Any = None
        self._peer_error: int | None = None

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, EOFError):
                pass

    def joined(self, member: Any) -> None:
        self._member = member
        self.members[member.rank] = member
        reader = threading.Thread(target=self._read, daemon=True, name=f"sim-nccl-conn {self.label}")
        reader._sim_unbound = True  # type: ignore[attr-defined]
        reader.start()
        self._send(("join", self.token, member.rank, self.nranks))
        self.nccl.sim._host_wait(lambda: self._ready, [member], f"ncclCommInitRank (rank {member.rank} of "
                                 f"{self.nranks}) on {self.label}, waiting for every rank to join")

    def post(self, post: Any, key: tuple[Any, ...], expected: tuple[int, ...]) -> None:
        match = self.matches[key] = sim_nccl.Match(key, expected)
        match.posts[post.member.rank] = post
        post.match = match

    def try_execute(self, match: sim_nccl.Match) -> None:
        """The kernel reached the call: send it and its data to the hub (the reply completes it)."""
        post = match.posts[self._member.rank]
        if getattr(post, "_sent", False):
            return
        post._sent = True
        send = None if post.send is None else post.send[0][post.send[1]:post.send[1] + post.send[2]].numpy().tobytes()
        recv_nbytes = 0 if post.recv is None else post.recv[2]
        self._send(("arrive", match.key, match.expected, post.call, send, recv_nbytes, post.time))

    def member_aborted(self, member: Any) -> None:
        self._send(("abort",))

    def member_destroyed(self, member: Any) -> None:
        self._send(("leave",))

    def remote_error(self, member: Any) -> int | None:
        return self._peer_error

    def _read(self) -> None:
        sim = self.nccl.sim
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("peer", -1, "the hub closed")
            with sim.lock:
                member = self._member
                kind = message[0]
                if kind == "ready":
                    self._ready = True
                elif kind == "done":
                    _, key, data, start = message
                    match = self.matches.pop(key, None)
                    if match is not None:
                        post = match.posts[member.rank]
                        if data is not None and post.recv is not None:
                            post.view("recv").copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(
                                sim_nccl.TORCH_DTYPES[post.call.dtype]))
                        match.executed, match.time, post.done = True, start, True
                elif kind == "failed":
                    _, key, text = message
                    match = self.matches.get(key)
                    if match is not None:
                        match.failed = text
                    self.nccl.mismatches.append(text)
                elif kind == "peer":
                    if self.nccl.abort_reaches_peers:
                        self._peer_error = sim_nccl.REMOTE_ERROR
                if member is not None:
                    member.changed()
            if kind == "peer" and message[1] == -1:
                return
