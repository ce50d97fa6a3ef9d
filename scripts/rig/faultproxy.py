#!/usr/bin/env python3
"""A fault and latency TCP proxy for the test rig (stdlib only).

    python scripts/rig/faultproxy.py --listen 127.0.0.1:0 --to 127.0.0.1:23061 \\
        --protocol mysql|postgresql|raw [--delay-ms 0.25]

prints ``LISTEN <port> CONTROL <port>`` once it is ready, then forwards every client
connection to ``--to`` until it is killed or told ``STOP``. Loopback only: a ``--listen``
or ``--to`` host outside 127.0.0.0/8 and ::1 is refused (it is a test tool, and it must
never become an open relay).

It reads the protocol as it passes, without changing a byte of it, to know each
connection's server-side session id (MySQL/MariaDB: the connection id of the server's
handshake; PostgreSQL: the pid of BackendKeyData) and to count the client's *requests*
(MySQL: every command packet, i.e. sequence id 0 after authentication; PostgreSQL: every
simple Query, and every Sync, which ends an extended-protocol batch). A connection that
switches to TLS is forwarded but no longer read (PostgreSQL's SSLRequest answered ``N`` is
handled: the connection stays readable).

The control channel (127.0.0.1, the CONTROL port) takes one text command a line and
answers one JSON line each (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``):

    DELAY <ms>                       each direction of every connection is delayed by ms
    ARM <session> <kind> <k> [ms]    fault the k-th request from now of that session:
        reset        both sockets reset (RST) when the request arrives, before any of
                     its bytes go to the server: the server never runs it
        lose_reply   the request goes to the server; its whole reply (up to MySQL's last
                     result / PostgreSQL's ReadyForQuery: the server finished it, and
                     committed if it was a COMMIT) is discarded and both sockets reset
        delay_reply  its reply is held ms milliseconds more
    DISARM [session]                 forget faults not fired yet
    COUNT <session>                  requests that session sent so far
    SESSIONS                         the sessions seen (open ones and recent closed ones)
    FAULTS [session]                 every fault armed, with its state (armed, fired, gone)
    RTT [samples]                    the round trip this proxy adds, measured through its
                                     own forwarding path to an internal echo server
    PING / STOP

``FaultProxy`` at the end is the client: it starts the proxy as a subprocess and talks
to its control channel (tests load this file with importlib: scripts/ is no package).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ipaddress
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOLS = ("mysql", "postgresql", "raw")
FAULT_KINDS = ("reset", "lose_reply", "delay_reply")
#: Closed connections remembered for COUNT/SESSIONS (a test asks after its connection died).
KEEP_CLOSED = 4096
READ_SIZE = 65536


# ── addresses ──


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; the host must be a loopback address literal."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not host:port: {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"not an IP address (loopback only): {host!r}") from None
    if not address.is_loopback:
        raise ValueError(f"refused: {host} is not a loopback address (127.0.0.0/8 or ::1)")
    return host, int(port)


# ── reading the protocols as they pass ──


@dataclass
class Event:
    """Something a scanner saw at ``offset`` of the chunk it was fed."""

    offset: int
    name: str
    value: Any = None


class Scanner:
    """Frames one direction of a connection into messages, chunk by chunk, without
    copying more than each message's first bytes (``want``); a message's header cut by
    the end of a chunk is left unconsumed, so an event's offset always falls inside
    the chunk it came with (a request is cut before its first byte, exactly)."""

    #: How much of each message's start the scanner keeps to look at.
    HEAD = 64

    def __init__(self, link: Link) -> None:
        self.link = link
        self.left = 0  # payload bytes of the current message still to come
        self.want = 0  # bytes of its payload to keep
        self.head = bytearray()
        self.head_done = True
        self.opaque = False

    def feed(self, buf: bytes) -> tuple[int, list[Event]]:
        events: list[Event] = []
        if self.opaque:
            return len(buf), events
        i, n = 0, len(buf)
        while True:
            if self.left:
                take = min(self.left, n - i)
                if not take:
                    break
                if len(self.head) < self.want:
                    self.head += buf[i : i + min(self.want - len(self.head), take)]
                i += take
                self.left -= take
                if not self.head_done and len(self.head) >= self.want:
                    self.head_done = True
                    self.message(bytes(self.head), events)
                continue
            if i >= n or self.opaque:
                break
            size = self.header_size()
            if size is None:  # from here on the stream is not read (TLS)
                self.opaque = True
                break
            if n - i < size:
                break
            self.left, self.want = self.start(buf, i, events)
            self.want = min(self.want, self.left)
            self.head = bytearray()
            self.head_done = False
            i += size
            if self.want == 0:
                self.head_done = True
                self.message(b"", events)
        return (n if self.opaque else i), events

    def header_size(self) -> int | None:
        raise NotImplementedError

    def start(self, buf: bytes, i: int, events: list[Event]) -> tuple[int, int]:
        """A message's header at ``buf[i:]``: answers (payload length, bytes to keep)."""
        raise NotImplementedError

    def message(self, head: bytes, events: list[Event]) -> None:
        """The first bytes of the current message's payload are in."""


class RawScanner(Scanner):
    def header_size(self) -> int | None:
        return None


# MySQL/MariaDB: packets are 3-byte LE length + 1-byte sequence id + payload; a payload of
# 0xFFFFFF bytes continues in the next packet.
FULL_PACKET = 0xFFFFFF
CLIENT_SSL = 0x0800
CLIENT_DEPRECATE_EOF = 0x01000000
SERVER_MORE_RESULTS_EXISTS = 0x0008
COM_QUIT, COM_QUERY, COM_FIELD_LIST, COM_CHANGE_USER = 0x01, 0x03, 0x04, 0x11
COM_STMT_PREPARE, COM_STMT_EXECUTE = 0x16, 0x17
COM_STMT_SEND_LONG_DATA, COM_STMT_CLOSE = 0x18, 0x19
#: Commands the server does not answer.
NO_REPLY = {COM_QUIT, COM_STMT_SEND_LONG_DATA, COM_STMT_CLOSE}


def lenenc(data: bytes, at: int) -> tuple[int, int]:
    """A length-encoded integer at ``data[at:]``: (value, bytes it took)."""
    if at >= len(data):
        return 0, 1
    first = data[at]
    if first < 0xFB:
        return first, 1
    size = {0xFC: 2, 0xFD: 3, 0xFE: 8}.get(first, 0)
    raw = data[at + 1 : at + 1 + size]
    return int.from_bytes(raw, "little"), 1 + size


class MySQLClientScanner(Scanner):
    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.continued = False  # the previous packet was full: this one continues it
        self.first = True  # the handshake response (or SSL request) comes first
        self.is_command = False

    def header_size(self) -> int | None:
        return 4

    def start(self, buf: bytes, i: int, events: list[Event]) -> tuple[int, int]:
        length = int.from_bytes(buf[i : i + 3], "little")
        seq = buf[i + 3]
        continuation, self.continued = self.continued, length == FULL_PACKET
        self.is_command = self.link.authed and seq == 0 and not continuation
        if self.is_command:
            events.append(Event(i, "request"))
        return length, 32 if self.first else 1

    def message(self, head: bytes, events: list[Event]) -> None:
        if self.first:
            self.first = False
            caps = int.from_bytes(head[:4], "little") if len(head) >= 4 else 0
            self.link.client_caps = caps
            if caps & CLIENT_SSL and len(head) == 32 and self.left == 0:
                # An SSL request: a TLS handshake follows, which this proxy does not read.
                events.append(Event(0, "tls"))
                self.opaque = True
        elif self.is_command and head:
            events.append(Event(0, "command", head[0]))


class MySQLServerScanner(Scanner):
    """Reads the server's handshake (the session id), the end of authentication, and
    where each command's reply ends (a lost reply is discarded whole)."""

    HEAD = 64

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.continued = False
        self.continuation = False
        self.length = 0
        self.handshake = True
        self.replies: deque[Reply] = deque()

    def header_size(self) -> int | None:
        return 4

    def start(self, buf: bytes, i: int, events: list[Event]) -> tuple[int, int]:
        length = int.from_bytes(buf[i : i + 3], "little")
        self.continuation, self.continued = self.continued, length == FULL_PACKET
        self.length = length
        return length, 128 if self.handshake else self.HEAD

    def message(self, head: bytes, events: list[Event]) -> None:
        if self.handshake:
            self.handshake = False
            # Protocol 10: version byte, NUL-terminated server version, 4-byte LE id.
            if head[:1] == b"\x0a" and b"\x00" in head[1:]:
                end = head.index(b"\x00", 1)
                if len(head) >= end + 5:
                    session = int.from_bytes(head[end + 1 : end + 5], "little")
                    events.append(Event(0, "session", session))
            return
        if self.continuation or not head:
            return
        if not self.link.authed:
            if head[0] == 0x00:
                events.append(Event(0, "authed"))
            return
        if not self.replies:
            return
        reply = self.replies[0]
        if reply.packet(head, self.length, self.link.deprecate_eof):
            self.replies.popleft()
            events.append(Event(0, "reply_end"))


@dataclass
class Reply:
    """Where the server's answer to one MySQL command ends: an OK or ERR, or a result
    set's last packet, without SERVER_MORE_RESULTS_EXISTS (multi-statements and a
    compound statement's SELECTs answer several results to one command)."""

    command: int
    state: str = "first"
    left: int = 0

    def packet(self, head: bytes, length: int, deprecate_eof: bool) -> bool:
        """Takes the reply's next packet; answers whether the reply ended with it."""
        kind = head[0]
        if kind == 0xFF:
            return True
        if self.command == COM_STMT_PREPARE:
            return self._prepare(head, kind, deprecate_eof)
        if self.command not in (COM_QUERY, COM_STMT_EXECUTE, COM_FIELD_LIST):
            return True  # one packet: OK, ERR, EOF or a string (COM_STATISTICS)
        if self.command == COM_FIELD_LIST:
            return kind == 0xFE and length < 9
        if self.state == "first":
            if kind == 0x00 and length >= 7 or kind == 0xFE and length < 9:
                return not self._more(head, length)
            if kind == 0xFB:
                return True  # LOCAL INFILE: not followed further
            columns, used = lenenc(head, 0)
            # MariaDB's metadata cache: a byte after the count says whether column
            # definitions follow.
            follows = head[used] if length > used else 1
            self.left = columns if follows else 0
            self.state = "columns" if self.left else ("rows" if deprecate_eof else "eof")
            return False
        if self.state == "columns":
            self.left -= 1
            if not self.left:
                self.state = "rows" if deprecate_eof else "eof"
            return False
        if self.state == "eof":
            self.state = "rows"
            return False
        # rows: ended by 0xFE (EOF, or OK with CLIENT_DEPRECATE_EOF) shorter than a full
        # packet; a row starting with 0xFE would be a value of 2^24 bytes or more.
        if kind == 0xFE and length < FULL_PACKET:
            if self._more(head, length):
                self.state = "first"
                return False
            return True
        return False

    def _prepare(self, head: bytes, kind: int, deprecate_eof: bool) -> bool:
        if self.state == "first":
            columns = int.from_bytes(head[5:7], "little")
            params = int.from_bytes(head[7:9], "little")
            eofs = 0 if deprecate_eof else int(columns > 0) + int(params > 0)
            self.left = columns + params + eofs
            self.state = "definitions"
            return self.left == 0
        self.left -= 1
        return self.left <= 0

    @staticmethod
    def _more(head: bytes, length: int) -> bool:
        if head[0] == 0xFE and length < 9:  # EOF: warnings, then status flags
            status = int.from_bytes(head[3:5], "little")
        else:  # OK: affected rows, last insert id, then status flags
            _, a = lenenc(head, 1)
            _, b = lenenc(head, 1 + a)
            status = int.from_bytes(head[1 + a + b : 3 + a + b], "little")
        return bool(status & SERVER_MORE_RESULTS_EXISTS)


# PostgreSQL: after the untyped startup message, every message is a type byte + int32
# length (counting itself).
SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST = 80877103, 80877104, 80877102
#: Client messages that end a request (the server answers ReadyForQuery to each).
PG_REQUEST_ENDS = {ord("Q"), ord("S"), ord("F")}


class PostgresClientScanner(Scanner):
    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.startup = True

    def header_size(self) -> int | None:
        return 8 if self.startup else 5

    def start(self, buf: bytes, i: int, events: list[Event]) -> tuple[int, int]:
        if self.startup:
            length, code = struct.unpack_from("!ii", buf, i)
            if code in (SSL_REQUEST, GSSENC_REQUEST):
                # The server answers one byte; the startup message comes after it.
                self.link.pending_answers += 1
            elif code == CANCEL_REQUEST:
                self.opaque = True
            else:
                self.startup = False
            return max(length - 8, 0), 0
        kind = buf[i]
        (length,) = struct.unpack_from("!i", buf, i + 1)
        link = self.link
        if link.authed and kind != ord("X"):
            if not link.in_request:
                link.in_request = True
                events.append(Event(i, "request"))
            if kind in PG_REQUEST_ENDS:
                link.in_request = False
        return max(length - 4, 0), 0


class PostgresServerScanner(Scanner):
    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.kind = 0

    def header_size(self) -> int | None:
        if self.link.pending_answers:
            return 1
        return 5

    def start(self, buf: bytes, i: int, events: list[Event]) -> tuple[int, int]:
        if self.link.pending_answers:
            self.link.pending_answers -= 1
            if buf[i] != ord("N"):  # 'S' (TLS) or 'G' (GSSAPI): no longer readable
                events.append(Event(i, "tls"))
                self.opaque = True
            self.kind = 0
            return 0, 0
        self.kind = buf[i]
        (length,) = struct.unpack_from("!i", buf, i + 1)
        return max(length - 4, 0), 8 if self.kind == ord("K") else 0

    def message(self, head: bytes, events: list[Event]) -> None:
        if self.kind == ord("K") and len(head) >= 4:
            events.append(Event(0, "session", struct.unpack_from("!i", head)[0]))
        elif self.kind == ord("Z"):
            if not self.link.authed:
                events.append(Event(0, "authed"))
            else:
                events.append(Event(0, "reply_end"))


SCANNERS: dict[str, tuple[type[Scanner], type[Scanner]]] = {
    "mysql": (MySQLClientScanner, MySQLServerScanner),
    "postgresql": (PostgresClientScanner, PostgresServerScanner),
    "raw": (RawScanner, RawScanner),
}


# ── forwarding ──


@dataclass
class Fault:
    id: int
    session: int
    kind: str
    k: int
    target: int  # the connection's request number it hits
    ms: float = 0.0
    state: str = "armed"  # armed → fired, or gone (the connection ended first)
    armed_at: float = field(default_factory=time.time)
    fired_at: float | None = None
    detail: str = ""


DATA, PAUSE, EOF, RESET = "data", "pause", "eof", "reset"
#: Waits shorter than this sleep in a thread (see ``Direction.write_loop``).
SHORT_WAIT_S = 0.005
_sleepers = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="delay")


class Direction:
    """One direction of a connection: a reader that scans each chunk as it arrives, and
    a writer that sends it ``delay`` later. Each direction of each connection has its
    own queue, so the delay models a network: order kept, nothing serialised."""

    def __init__(
        self,
        link: Link,
        name: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        scanner: Scanner,
    ) -> None:
        self.link = link
        self.name = name
        self.reader = reader
        self.writer = writer  # where this direction's bytes go
        self.scanner = scanner
        self.queue: asyncio.Queue[tuple[float, str, Any]] = asyncio.Queue()
        self.pending = b""
        self.stopped = False

    def put(self, kind: str, payload: Any = None, extra_s: float = 0.0) -> None:
        due = asyncio.get_running_loop().time() + self.link.proxy.delay_s + extra_s
        self.queue.put_nowait((due, kind, payload))

    async def read_loop(self) -> None:
        try:
            while not self.stopped:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    if not self.stopped:
                        self.put(EOF)
                    return
                if not self.stopped:
                    self.link.on_data(self, data)
        except (ConnectionError, OSError):
            self.link.reset("peer reset")

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, kind, payload = await self.queue.get()
                wait = due - loop.time()
                if 0 < wait < SHORT_WAIT_S:
                    # The event loop sleeps in whole milliseconds (epoll's timeout): a
                    # 0.25 ms delay would cost a millisecond or more. A thread's sleep is
                    # good to tens of microseconds, and its end wakes the loop at once.
                    await loop.run_in_executor(_sleepers, time.sleep, wait)
                elif wait > 0:
                    await asyncio.sleep(wait)
                if kind == DATA:
                    self.writer.write(payload)
                    await self.writer.drain()
                elif kind == PAUSE:
                    await asyncio.sleep(payload)
                elif kind == EOF:
                    self.link.half_closed(self)
                    return
                elif kind == RESET:
                    self.link.reset(payload)
                    return
        except (ConnectionError, OSError):
            self.link.reset("peer reset")


class Link:
    """One proxied client connection and its server connection."""

    def __init__(self, proxy: Proxy, number: int, peer: Any) -> None:
        self.proxy = proxy
        self.number = number
        self.peer = peer
        self.session: int | None = None
        self.requests = 0
        self.authed = False
        self.in_request = False  # PostgreSQL: a batch begun, its Sync not seen yet
        self.pending_answers = 0  # PostgreSQL: SSLRequest answers to come
        self.client_caps = 0
        self.tls = False
        self.open = True
        self.losing: Fault | None = None  # lose_reply: the reply being discarded
        self.delaying: Fault | None = None  # delay_reply: the reply to hold
        self.faults: list[Fault] = []
        self.eofs = 0
        self.up: Direction
        self.down: Direction
        self.directions: list[Direction] = []
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def deprecate_eof(self) -> bool:
        return bool(self.client_caps & CLIENT_DEPRECATE_EOF)

    async def run(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        target: tuple[str, int],
        protocol: str,
    ) -> None:
        try:
            server = await asyncio.open_connection(*target)
        except OSError:
            abort(client[1])
            return
        up_scanner, down_scanner = SCANNERS[protocol]
        self.up = Direction(self, "up", client[0], server[1], up_scanner(self))
        self.down = Direction(self, "down", server[0], client[1], down_scanner(self))
        self.directions = [self.up, self.down]
        self.tasks = [
            asyncio.ensure_future(coroutine)
            for d in (self.up, self.down)
            for coroutine in (d.read_loop(), d.write_loop())
        ]
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.closed()

    # data as it arrives

    def on_data(self, direction: Direction, data: bytes) -> None:
        buf = direction.pending + data
        used, events = direction.scanner.feed(buf)
        direction.pending = buf[used:]
        sent = 0
        for event in events:
            if event.name == "request":
                # The bytes before the request belong to the one before it.
                self.forward(direction, buf[sent : event.offset])
                sent = event.offset
                if not self.request_starts():
                    direction.stopped = True
                    return
            else:
                self.note(event)
        self.forward(direction, buf[sent:used])

    def forward(self, direction: Direction, data: bytes) -> None:
        if not data:
            return
        if direction is self.down:
            if self.losing is not None:
                return  # the reply of a lose_reply request: discarded
            if self.delaying is not None:
                direction.put(PAUSE, self.delaying.ms / 1000)
                self.fired(self.delaying)
                self.delaying = None
        direction.put(DATA, data)

    def note(self, event: Event) -> None:
        if event.name == "session":
            self.session = int(event.value)
            self.proxy.sessions[self.session] = self
        elif event.name == "authed":
            self.authed = True
        elif event.name == "tls":
            # Encrypted from here on, both ways: nothing more to read.
            self.tls = True
            self.up.scanner.opaque = self.down.scanner.opaque = True
        elif event.name == "command":
            if event.value == COM_CHANGE_USER:
                self.authed = False  # an authentication exchange again, not a reply
            elif event.value not in NO_REPLY and isinstance(self.down.scanner, MySQLServerScanner):
                self.down.scanner.replies.append(Reply(int(event.value)))
        elif event.name == "reply_end" and self.losing is not None:
            fault, self.losing = self.losing, None
            self.fired(fault)
            self.down.stopped = True
            self.down.put(RESET, "lose_reply")

    def request_starts(self) -> bool:
        """A request's first byte arrived: count it, and apply a fault armed for it.
        Answers False when the connection is being reset (nothing more to forward)."""
        self.requests += 1
        for fault in self.faults:
            if fault.state != "armed" or fault.target != self.requests:
                continue
            if fault.kind == "reset":
                self.fired(fault)
                self.up.put(RESET, "reset")
                return False
            if fault.kind == "lose_reply":
                self.losing = fault
            elif fault.kind == "delay_reply":
                self.delaying = fault
        return True

    def fired(self, fault: Fault) -> None:
        fault.state = "fired"
        fault.fired_at = time.time()

    # ends

    def half_closed(self, direction: Direction) -> None:
        try:
            if direction.writer.can_write_eof():
                direction.writer.write_eof()
        except (OSError, RuntimeError):
            pass
        self.eofs += 1
        if self.eofs == 2:
            for d in self.directions:
                d.writer.close()
            self.cancel()

    def reset(self, why: str) -> None:
        """Both sockets closed with RST (SO_LINGER 0): each peer sees a reset, not an
        orderly end of stream."""
        if not self.open:
            return
        self.open = False
        for d in self.directions:
            d.stopped = True
            abort(d.writer)
        self.cancel()

    def cancel(self) -> None:
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()

    def closed(self) -> None:
        self.open = False
        for fault in self.faults:
            if fault.state == "armed":
                fault.state = "gone"
                fault.detail = "the connection ended before the fault could happen"
        self.proxy.closed(self)

    def summary(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "peer_port": self.peer[1] if self.peer else None,
            "requests": self.requests,
            "open": self.open,
            "tls": self.tls,
        }


def abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


# ── the proxy ──


class Proxy:
    def __init__(self, target: tuple[str, int], protocol: str, delay_ms: float) -> None:
        self.target = target
        self.protocol = protocol
        self.delay_s = delay_ms / 1000
        self.sessions: dict[int, Link] = {}
        self.closed_links: deque[Link] = deque()
        self.faults: list[Fault] = []
        self.links = 0
        self.open_links: set[Link] = set()
        self.stopping = asyncio.Event()
        self._rtt_target: tuple[str, int] | None = None

    async def serve(self, listen: tuple[str, int]) -> tuple[int, int]:
        server = await asyncio.start_server(self._client, *listen)
        control = await asyncio.start_server(self._control, "127.0.0.1", 0)
        self.servers = [server, control]
        return server.sockets[0].getsockname()[1], control.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.relay(reader, writer, self.target, self.protocol)

    async def relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        target: tuple[str, int],
        protocol: str,
    ) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.links += 1
        link = Link(self, self.links, writer.get_extra_info("peername"))
        self.open_links.add(link)
        try:
            await link.run((reader, writer), target, protocol)
        except asyncio.CancelledError:
            pass  # stopping: the connection was reset
        finally:
            self.open_links.discard(link)

    async def shutdown(self) -> None:
        """Stop listening and reset every connection still open: a client of a stopped
        proxy sees its connection fail at once rather than hang."""
        for server in self.servers:
            server.close()
        for link in list(self.open_links):
            link.reset("the proxy stopped")
        deadline = asyncio.get_running_loop().time() + 2
        while self.open_links and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    def closed(self, link: Link) -> None:
        """A closed connection stays known (a test asks after its connection died), up
        to ``KEEP_CLOSED`` of them, so a long benchmark does not keep every one."""
        if link.session is None:
            return
        self.closed_links.append(link)
        if len(self.closed_links) > KEEP_CLOSED:
            old = self.closed_links.popleft()
            if old.session is not None and self.sessions.get(old.session) is old:
                del self.sessions[old.session]

    # control channel

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    answer = await self.command(line.decode().split())
                except Exception as exc:  # a bad command answers an error, never kills
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                writer.write((json.dumps(answer) + "\n").encode())
                await writer.drain()
                if answer.get("stopping"):
                    self.stopping.set()
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def link_of(self, session: str) -> Link:
        link = self.sessions.get(int(session))
        if link is None:
            raise KeyError(f"unknown session {session}")
        return link

    async def command(self, words: list[str]) -> dict[str, Any]:
        if not words:
            raise ValueError("empty command")
        name, args = words[0].upper(), words[1:]
        if name == "PING":
            return {"ok": True}
        if name == "DELAY":
            self.delay_s = max(float(args[0]), 0.0) / 1000
            return {"ok": True, "delay_ms": self.delay_s * 1000}
        if name == "ARM":
            return {"ok": True, "fault": asdict(self.arm(*args))}
        if name == "DISARM":
            for fault in self.faults:
                if fault.state == "armed" and (not args or fault.session == int(args[0])):
                    fault.state = "gone"
                    fault.detail = "disarmed"
            return {"ok": True}
        if name == "COUNT":
            return {"ok": True, "count": self.link_of(args[0]).requests}
        if name == "SESSIONS":
            return {"ok": True, "sessions": [link.summary() for link in self.sessions.values()]}
        if name == "FAULTS":
            faults = [f for f in self.faults if not args or f.session == int(args[0])]
            return {"ok": True, "faults": [asdict(f) for f in faults]}
        if name == "RTT":
            return {"ok": True, **(await self.rtt(int(args[0]) if args else 20))}
        if name == "STOP":
            return {"ok": True, "stopping": True}
        raise ValueError(f"unknown command {name}")

    def arm(self, session: str, kind: str, k: str = "1", ms: str = "0") -> Fault:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r} (one of {', '.join(FAULT_KINDS)})")
        if int(k) < 1:
            raise ValueError("k counts from 1 (the next request)")
        link = self.link_of(session)
        if not link.open:
            raise ValueError(f"session {session} is closed")
        if link.tls:
            raise ValueError(f"session {session} uses TLS: its requests cannot be counted")
        fault = Fault(
            id=len(self.faults) + 1,
            session=int(session),
            kind=kind,
            k=int(k),
            target=link.requests + int(k),
            ms=float(ms),
        )
        self.faults.append(fault)
        link.faults.append(fault)
        return fault

    # the round trip this proxy adds

    async def rtt(self, samples: int) -> dict[str, Any]:
        """Round trips of one byte to an internal echo server, straight and through a
        raw link of this proxy (its own forwarding path, with the current delay)."""
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        echo_address = echo.sockets[0].getsockname()[:2]
        relay = await asyncio.start_server(
            lambda r, w: self.relay(r, w, echo_address, "raw"), "127.0.0.1", 0
        )
        try:
            direct = await _round_trips(echo_address, samples)
            through = await _round_trips(relay.sockets[0].getsockname()[:2], samples)
        finally:
            for server in (relay, echo):
                server.close()
        return {
            "delay_ms": self.delay_s * 1000,
            "direct_ms": statistics.median(direct) * 1000,
            "through_ms": statistics.median(through) * 1000,
            "added_ms": (statistics.median(through) - statistics.median(direct)) * 1000,
            "samples": samples,
        }


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while data := await reader.read(READ_SIZE):
            writer.write(data)
            await writer.drain()
    except (asyncio.CancelledError, ConnectionError):
        pass
    finally:
        writer.close()


async def _round_trips(address: tuple[str, int], samples: int) -> list[float]:
    reader, writer = await asyncio.open_connection(*address)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    try:
        for _ in range(max(samples, 1)):
            start = time.perf_counter()
            writer.write(b"x")
            await writer.drain()
            await reader.readexactly(1)
            times.append(time.perf_counter() - start)
    finally:
        writer.close()
    return times


async def main_async(args: argparse.Namespace) -> None:
    proxy = Proxy(parse_address(args.to), args.protocol, args.delay_ms)
    port, control = await proxy.serve(parse_address(args.listen))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, proxy.stopping.set)
    if args.exit_on_stdin_eof:
        # The parent that started us holds our stdin: when it dies, so do we.
        threading.Thread(target=_wait_stdin_eof, args=(loop, proxy), daemon=True).start()
    print(f"LISTEN {port} CONTROL {control}", flush=True)
    await proxy.stopping.wait()
    await proxy.shutdown()


def _wait_stdin_eof(loop: asyncio.AbstractEventLoop, proxy: Proxy) -> None:
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts
    # the interpreter's shutdown.
    while os.read(0, 4096):
        pass
    loop.call_soon_threadsafe(proxy.stopping.set)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--to", required=True)
    parser.add_argument("--protocol", choices=PROTOCOLS, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    args = parser.parse_args(argv)
    try:
        parse_address(args.listen)
        parse_address(args.to)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(main_async(args))
    return 0


# ── the client ──


class FaultProxyError(RuntimeError):
    pass


class FaultProxy:
    """Starts the proxy as a subprocess and drives it through its control channel.

    >>> with FaultProxy(("127.0.0.1", 23061), "mysql") as proxy:
    ...     connect_to("127.0.0.1", proxy.port)
    ...     proxy.arm(session_id, "lose_reply", 1)
    """

    def __init__(
        self,
        target: tuple[str, int],
        protocol: str,
        *,
        delay_ms: float = 0.0,
        listen: str = "127.0.0.1:0",
        start_timeout_s: float = 30.0,
    ) -> None:
        self.target = (parse_address(f"{target[0]}:{target[1]}")[0], int(target[1]))
        self.protocol = protocol
        self.delay_ms = delay_ms
        self.listen = listen
        self.start_timeout_s = start_timeout_s
        self.host = parse_address(listen)[0]
        self.port = 0
        self.control_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def start(self) -> FaultProxy:
        host, port = self.target
        self.process = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--listen",
                self.listen,
                "--to",
                f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                "--protocol",
                self.protocol,
                "--delay-ms",
                str(self.delay_ms),
                "--exit-on-stdin-eof",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        line = self._first_line()
        words = line.split()
        if len(words) != 4 or words[0] != "LISTEN" or words[2] != "CONTROL":
            self.stop()
            raise FaultProxyError(f"faultproxy did not start: {line!r}")
        self.port, self.control_port = int(words[1]), int(words[3])
        try:
            self._control = socket.create_connection(("127.0.0.1", self.control_port), timeout=60)
        except OSError:
            self.stop()
            raise
        return self

    def _first_line(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], self.start_timeout_s)
        if not ready:
            self.stop()
            raise FaultProxyError("faultproxy did not print its ports in time")
        return self.process.stdout.readline().decode().strip()

    def command(self, *words: object) -> dict[str, Any]:
        """One control command; answers its JSON reply, raising when it says not ok."""
        if self._control is None:
            raise FaultProxyError("the proxy is not running")
        with self._lock:
            self._control.sendall((" ".join(str(w) for w in words) + "\n").encode())
            while b"\n" not in self._buffer:
                chunk = self._control.recv(65536)
                if not chunk:
                    raise FaultProxyError("the proxy closed its control channel")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if answer.get("ok") is not True:
            raise FaultProxyError(f"{' '.join(map(str, words))}: {answer.get('error')}")
        return answer

    def arm(self, session: int, kind: str, k: int = 1, ms: float = 0.0) -> dict[str, Any]:
        """Fault the k-th request from now of ``session``; answers the fault (its ``id``)."""
        fault: dict[str, Any] = self.command("ARM", session, kind, k, ms)["fault"]
        return fault

    def disarm(self, session: int | None = None) -> None:
        self.command("DISARM", *([] if session is None else [session]))

    def count(self, session: int) -> int:
        return int(self.command("COUNT", session)["count"])

    def sessions(self) -> list[dict[str, Any]]:
        sessions: list[dict[str, Any]] = self.command("SESSIONS")["sessions"]
        return sessions

    def faults(self, session: int | None = None) -> list[dict[str, Any]]:
        faults: list[dict[str, Any]] = self.command(
            "FAULTS", *([] if session is None else [session])
        )["faults"]
        return faults

    def fired(self, session: int | None = None) -> list[dict[str, Any]]:
        """The faults (of ``session``, or all) that actually happened."""
        return [f for f in self.faults(session) if f["state"] == "fired"]

    def delay(self, ms: float) -> None:
        """From now on, each direction of every connection is ``ms`` late."""
        self.command("DELAY", ms)
        self.delay_ms = ms

    def rtt(self, samples: int = 20) -> dict[str, Any]:
        return self.command("RTT", samples)

    def stop(self) -> None:
        process, self.process = self.process, None
        if self._control is not None:
            try:
                self.command("STOP")
            except (OSError, FaultProxyError, ValueError):
                pass
            self._control.close()
            self._control = None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
