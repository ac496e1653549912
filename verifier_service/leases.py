"""Which caller's lease holds which sessions, and which leases have ended: sessions die with their caller.

A caller (`specmesh serve`'s engine core for one replica) holds a ``Verifier.Lease`` stream open for as long as
it lives and names the lease in each Prefill. When the caller dies (kill -9, a crash, a restart) its connection
closes, the stream ends, and ``grace`` seconds later (time to reconnect and attach again after a blip) every
session of that lease is released: its KV blocks go back in seconds, not at ``--session-ttl`` (the backstop for
callers without a lease). A lease named by a Prefill but never attached expires the same way.

Plain bookkeeping, no gRPC: the servicer (verifier_service/server.py) attaches and detaches streams, adds and
drops sessions, and releases what ``expired`` returns. Leases and sessions are the servicer's keys (the caller's
identity and its id): one caller's lease can never end another's sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEASE_GRACE = 2.0  # seconds after a lease's last stream ended (or it was first named, unattached) until it expires
LEASE_SWEEP = 0.25  # seconds between two looks for expired leases


@dataclass
class _Lease:
    streams: int = 0  # open Lease streams
    unheld_since: float = 0.0  # when the count last fell to 0 (or the lease was first named)
    sessions: set[str] = field(default_factory=set)


class Leases:
    """Leases, their open streams and their sessions (one thread: the servicer's event loop)."""

    def __init__(self, grace: float = LEASE_GRACE) -> None:
        self.grace = grace
        self.frozen = False  # draining: nothing expires any more (the process is ending; Release still frees)
        self._leases: dict[str, _Lease] = {}
        self._lease_of: dict[str, str] = {}  # session -> its lease

    def attach(self, lease: str, now: float) -> None:
        self._leases.setdefault(lease, _Lease(unheld_since=now)).streams += 1

    def detach(self, lease: str, now: float) -> None:
        entry = self._leases.get(lease)
        if entry is None:
            return
        entry.streams -= 1
        if entry.streams == 0:
            if not entry.sessions:
                del self._leases[lease]
            else:
                entry.unheld_since = now

    def add_session(self, lease: str, session: str, now: float) -> None:
        """``session`` (just prefilled) ends with ``lease``."""
        self.drop_session(session)
        self._leases.setdefault(lease, _Lease(unheld_since=now)).sessions.add(session)
        self._lease_of[session] = lease

    def drop_session(self, session: str) -> None:
        """``session`` ended otherwise (Release, --session-ttl): no lease holds it any more."""
        lease = self._lease_of.pop(session, None)
        if lease is None:
            return
        entry = self._leases[lease]
        entry.sessions.discard(session)
        if not entry.sessions and entry.streams == 0:
            del self._leases[lease]

    def keep_only(self, sessions: set[str]) -> None:
        """Forget the sessions not in ``sessions`` (the replica's own, e.g. ended by a failed step)."""
        for session in [s for s in self._lease_of if s not in sessions]:
            self.drop_session(session)

    def expired(self, now: float) -> list[str]:
        """The sessions of every lease unheld for longer than the grace, forgotten with their leases."""
        if self.frozen:
            return []
        ended = [lease for lease, e in self._leases.items() if e.streams == 0 and now - e.unheld_since > self.grace]
        sessions = []
        for lease in ended:
            for session in self._leases.pop(lease).sessions:
                self._lease_of.pop(session, None)
                sessions.append(session)
        return sessions

    @property
    def num_leases(self) -> int:
        return len(self._leases)
