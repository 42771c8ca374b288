"""A TLS stream over a trio socket that hands the reader everything already received, and
encrypts large writes in a sender thread.

``trio.SSLStream`` returns at most one TLS record per ``receive_some``: a client that sends
each pagestream request in its own ``send`` (a compute's smgr, the benchmarks) then reaches
the page service one request per receive, and the pipeline's batching (which folds whatever
arrived while the executor was busy) falls from ~24 requests per batch to ~3. This stream
decrypts every complete record that is buffered before returning, so a receive over TLS
yields what a receive over plaintext TCP would.

Built on ``ssl.SSLObject`` with memory BIOs (what ``trio.SSLStream`` uses too), server or
client side. Rules: one task receives and one task sends at a time (the libpq rule of
``common.pgserver``); TLS 1.3 post-handshake messages a read produces (key updates) are sent
in order with the data. EOF without close_notify is reported as EOF (``b""``): the libpq and
pagestream framing above detects truncation itself.

Fast paths for a caller that manages its own schedule points (the page service's
``DirectStreamIO``, as it does on plaintext sockets): ``receive_nowait`` decrypts what is
buffered and reads the socket once without blocking; ``send_nowait`` encrypts and writes what
the socket takes now, and ``flush`` waits for the rest. Neither costs an event-loop iteration
when the socket is ready.

Large writes leave in pieces: a write of more than ``STREAM_PIECE`` bytes (a pipelined batch's
responses) is encrypted and written ``STREAM_PIECE`` at a time, each piece on the socket before
the next is encrypted, so the peer decrypts the first pages (and a closed-loop client answers
them) while the rest is still being encrypted, instead of after the whole batch.

The sender thread (``offload=True``, or ``"auto"``: only while the event loop's thread waits
for a CPU, see ``CpuContention``; ``send_nowait`` of ``OFFLOAD_MIN_BYTES`` or more): the cipher costs ~3 µs per 8 KiB page, on the trio thread that also plans and
gathers the next batch. A write that large is handed to a thread of this connection instead,
which encrypts it in pieces (OpenSSL releases the GIL in ``SSL_write``) and writes them to the
socket, so the page service goes on with its next batch on the other core. Smaller writes
(queue depth 1: one page per write) stay inline, where a hand-off (~5 µs on the trio thread,
and a thread wake in the response's latency) would cost more than it saves. With a core free
the thread costs more CPU per page than the cipher it moves (the GIL and the wake-ups) and
loses; when other processes keep the event loop's thread waiting for a CPU, the thread's
second share of the CPU wins. So the page service's default is ``"auto"``
(``PgServerConfig.tls_sender_thread``). ``SSLObject`` is not thread-safe: every call on it
and its BIOs holds ``_ssl_lock``. While the thread has a job the trio side only *tries* it (a
read that finds the thread encrypting waits for it in ``wait_readable``); it takes it outright
only when no job is queued, when at most the thread's last release is still under way. Bytes go
to the socket in order: while the thread has work, everything sent joins its queue.
"""

from __future__ import annotations

import os
import queue
import select
import ssl
import threading
import time
from collections.abc import Callable
from typing import Literal, cast

import trio

from common.linger import linger

RECEIVE_SIZE = 256 * 1024
# send_nowait encrypts and writes a large write inline in pieces of this many plaintext bytes.
STREAM_PIECE = 64 * 1024
# A write of this many plaintext bytes or more is encrypted by the sender thread (4 pages).
OFFLOAD_MIN_BYTES = 32 * 1024
# The sender encrypts at most this much per hold of the SSL lock, then writes it: a whole
# batch's response in one piece (each piece costs the thread the GIL twice more, and smaller
# pieces measured worse: 64 KiB pieces cost 9.6 µs per page in the thread against 7.7), but
# a bound on how long a reader can find the lock taken.
OFFLOAD_PIECE = 512 * 1024
# ``send_nowait`` answers "wait" (False) once the thread holds more than this unsent.
OFFLOAD_BACKLOG = 1 << 20
# The sender thread exits after this long without work (a new one starts on the next large
# write), and looks this often whether the connection has been closed under it.
SENDER_IDLE_EXIT_S = 2.0
SENDER_TICK_S = 0.25

# offload="auto": hand large writes to the sender thread only while the calling thread (the
# event loop's) spends more than this share of the wall clock waiting for a CPU (the kernel's
# run-queue delay), judged over windows of at least SENDER_SAMPLE_S.
SENDER_CONTENDED = 0.10
SENDER_SAMPLE_S = 0.1
# a sample this long after the one before starts a window rather than ending one
SENDER_STALE_S = 10 * SENDER_SAMPLE_S

_Job = tuple[memoryview, bytes | bytearray | memoryview]  # (ciphertext first, plaintext)
Offload = bool | Literal["auto"]


class CpuContention:
    """Whether the thread that calls it waited for a CPU for more than ``SENDER_CONTENDED`` of
    the last window: the second field of ``/proc/thread-self/schedstat`` (nanoseconds spent
    runnable on a run queue), read at most once per ``SENDER_SAMPLE_S`` (a procfs read, no
    disk); a sample more than ``SENDER_STALE_S`` after the one before only starts the next
    window. No such file (not Linux): never contended."""

    def __init__(
        self,
        path: str = "/proc/thread-self/schedstat",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._clock = clock
        self._at = -1.0
        self._delay = -1
        self.contended = False

    def __call__(self) -> bool:
        now = self._clock()
        if self._at >= 0 and now - self._at < SENDER_SAMPLE_S:
            return self.contended
        try:
            with open(self._path, "rb") as f:
                delay = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            self.contended = False
            self._at = now
            return False
        # After an idle gap the delay since the last sample says nothing about the last
        # window (a burst on a loaded host would read as "not contended", diluted over the
        # gap): such a sample is only the next window's start, and the verdict stays.
        if self._delay >= 0 and now - self._at <= SENDER_STALE_S:
            self.contended = (delay - self._delay) / 1e9 > SENDER_CONTENDED * (now - self._at)
        self._at, self._delay = now, delay
        return self.contended


class TlsStream(trio.abc.Stream):
    def __init__(
        self,
        transport: trio.SocketStream,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        offload: Offload = False,
    ) -> None:
        self.transport_stream = transport
        # Set by a server ending the connection with an error: aclose() then lingers after
        # close_notify (common.linger), so the error is not lost to a reset.
        self.linger_on_close = False
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        # True while one task is sending the outgoing BIO. Not a trio.Lock: acquiring one is a
        # schedule point per send, and the only second sender (a read that produced a TLS
        # 1.3 post-handshake message) is rare.
        self._sending = False
        self._idle = trio.Event()
        self._eof = False
        # Decrypted bytes land here: SSLObject.read(n) without a buffer allocates n bytes per
        # call (a 256 KiB allocation per TLS record, and per call that finds none).
        self._buf = bytearray(RECEIVE_SIZE)
        self._view = memoryview(self._buf)
        self._raw = bytearray(RECEIVE_SIZE)
        self._raw_view = memoryview(self._raw)
        self._fd = transport.socket.fileno()
        # encrypted bytes taken from the outgoing BIO and not yet written (send_nowait)
        self._unsent = memoryview(b"")
        # Set by receive_nowait: its socket read found the kernel drained and every complete
        # record decrypted (the page service's Reading then parks before reading again, as it
        # does on plaintext, instead of a read that can only find EAGAIN).
        self.drained = False
        # Whether the last _read_plain left bytes in the incoming BIO or the SSL object.
        self._rest = False
        # -- the sender thread (module docstring) --
        self._offload_min = OFFLOAD_MIN_BYTES if offload else 1 << 62
        # "auto": only while the event loop's thread is starved of CPU (CpuContention)
        self._contended: Callable[[], bool] | None = CpuContention() if offload == "auto" else None
        self._piece = STREAM_PIECE
        self._offload_piece = OFFLOAD_PIECE
        # Every call on _obj, _in and _out holds it (free whenever no job is queued).
        self._ssl_lock = threading.Lock()
        # Socket bytes read while the thread held the SSL lock, for the incoming BIO later.
        self._stashed = bytearray()
        self._stashed_eof = False
        # Guards the fields below, shared with the thread; never held while waiting.
        self._state = threading.Lock()
        self._sender: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._queued = 0  # jobs handed to the thread and not finished (only we increment it)
        self._backlog = 0  # their bytes not yet written
        self._sender_error: BaseException | None = None
        self._closing = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake: trio.Event | None = None  # set by the thread on its next progress
        self._read_busy = False  # the last receive_nowait found the SSL lock taken
        self.offloaded = 0  # writes the thread encrypted (tests, benchmarks)

    # -- the trio side -----------------------------------------------------------------------

    async def _flush(self) -> None:
        """Every encrypted byte on its way: the thread's queue drained, then our own."""
        await self._wait_sender(0)
        while self._sending:
            await self._idle.wait()  # the other task's loop sends what is pending now
        await self._wait_sender(0)
        if not self._out.pending and not self._unsent:
            return
        self._sending = True
        try:
            while self._unsent or self._out.pending:
                chunk = self._unsent if self._unsent else memoryview(self._take_out())
                self._unsent = memoryview(b"")
                await self.transport_stream.send_all(chunk)
        finally:
            self._sending = False
            self._idle.set()
            self._idle = trio.Event()

    def _take_out(self) -> bytes:
        with self._ssl_lock:  # free: only called with no job queued
            return self._out.read()

    def _feed(self, data: memoryview) -> None:
        """Socket bytes (``b""``: its EOF) into the incoming BIO, or stashed for
        ``_read_plain`` while the thread holds the SSL lock (never waiting for it)."""
        if not data:
            self._eof = True
        if self._ssl_lock.acquire(blocking=False):
            try:
                if data:
                    self._in.write(data)
                else:
                    self._in.write_eof()
            finally:
                self._ssl_lock.release()
        elif data:
            self._stashed += data
        else:
            self._stashed_eof = True

    async def _fill(self) -> None:
        # recv_into one buffer: SocketStream.receive_some(n) allocates n bytes per call.
        try:
            n = await self.transport_stream.socket.recv_into(self._raw_view)
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        self._feed(self._raw_view[:n])

    async def do_handshake(self) -> None:
        while True:
            try:
                with self._ssl_lock:  # free: nothing is sent before the handshake ends
                    self._obj.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
                if self._eof:
                    raise trio.BrokenResourceError("peer closed during the TLS handshake") from None
                continue
            except ssl.SSLError as exc:
                await self._flush_quietly()
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
            await self._flush()
            return

    async def _flush_quietly(self) -> None:
        try:
            await self._flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def getpeercert(self) -> dict[str, object] | None:
        cert = self._obj.getpeercert()
        return dict(cert) if cert else None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = min(max_bytes or RECEIVE_SIZE, RECEIVE_SIZE)
        waited = False  # a receive that awaited the socket has had its schedule point
        while True:
            have = self._read_plain(limit)
            if have is None:
                await self._wait_ssl_lock()
                waited = True
                continue
            if not self._queued and self._out.pending:
                await self._flush()
            if have or self._eof:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return bytes(self._view[:have])
            await self._fill()
            waited = True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check_sender()
        if self._queued:
            # After what the thread has, in order; a copy, since a cancelled wait below would
            # hand the caller its buffer back while the thread may still read it.
            self._offload(bytes(data))
            await self._flush()
            return
        # In pieces, each on its way before the next is encrypted (as send_nowait does).
        view = memoryview(data)
        for at in range(0, max(len(view), 1), self._piece):
            self._write_inline(view[at : at + self._piece])
            await self._flush()

    def _write_inline(self, data: bytes | bytearray | memoryview) -> None:
        try:
            with self._ssl_lock:  # free: no job is queued
                self._obj.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc

    # -- fast paths (no schedule point; see the module docstring) ---------------------------

    def _write_nowait(self) -> bool:
        """Write pending encrypted bytes as far as the socket takes them; True when none is
        left. Only when no task is in ``_flush`` (it owns the order of the bytes then) and no
        job is queued (the thread takes what is in the outgoing BIO then)."""
        if self._sending or self._queued:
            return not self._unsent and not self._sending
        while True:
            if not self._unsent:
                if not self._out.pending:
                    return True
                self._unsent = memoryview(self._take_out())
            try:
                n = os.write(self._fd, self._unsent)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            self._unsent = self._unsent[n:]

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Encrypt ``data`` and write what the socket takes now, or hand it to the sender
        thread; True when nothing is left for the caller to wait for, else ``flush()``
        (which sends the rest in order, before anything sent later). ``data`` must not
        change afterwards: the thread may still be reading it."""
        self._check_sender()
        if self._queued or (
            len(data) >= self._offload_min
            and not self._sending
            and (self._contended is None or self._contended())
        ):
            return self._offload(data)
        piece = self._piece
        if len(data) <= piece or self._sending:
            self._write_inline(data)
            return self._write_nowait()
        # A batch's responses leave in pieces, each written as soon as it is encrypted: the
        # peer decrypts (and, in a closed loop, answers) the first while we encrypt the next.
        view = memoryview(data)
        for at in range(0, len(view), piece):
            self._write_inline(view[at : at + piece])
            if not self._write_nowait():
                if at + piece < len(view):  # the socket is full: flush() writes the rest
                    self._write_inline(view[at + piece :])
                return False
        return True

    async def flush(self) -> None:
        """Wait until the sender thread's backlog is at most ``OFFLOAD_BACKLOG`` and every
        byte encrypted here is written: what ``send_nowait`` returning False asks for."""
        await self._wait_sender(OFFLOAD_BACKLOG)
        if not self._queued and (self._unsent or self._out.pending):
            await self._flush()

    def _read_plain(self, limit: int) -> int | None:
        """Decrypt into ``_view``; the count, or None while the thread holds the SSL lock."""
        if not self._ssl_lock.acquire(blocking=False):
            return None
        view, obj, incoming = self._view, self._obj, self._in
        have = 0
        try:
            if self._stashed or self._stashed_eof:
                incoming.write(self._stashed)
                self._stashed.clear()
                if self._stashed_eof:
                    incoming.write_eof()
                    self._stashed_eof = False
            # Only when a read can give something: bytes in the incoming BIO, decrypted bytes
            # in the SSL object, or the socket's EOF (read() reports it). A read that cannot
            # raises SSLWantReadError, and building that exception costs more than the read
            # of a small request: without the check every receive ended in one.
            while have < limit and (incoming.pending or obj.pending() or incoming.eof):
                # With a buffer, read() returns the count (typeshed says bytes).
                n = cast(int, obj.read(limit - have, view[have:limit]))
                if not n:
                    break
                have += n
        except ssl.SSLWantReadError:
            pass  # a partial record: the rest is still on its way
        except ssl.SSLZeroReturnError:
            self._eof = True
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
        finally:
            self._rest = bool(incoming.pending or obj.pending())
            self._ssl_lock.release()
        return have

    def receive_nowait(self, max_bytes: int) -> bytes | None:
        """``receive_some`` without waiting: the decrypted bytes of every complete record
        already received (the socket read once, without blocking), ``b""`` at EOF, or None
        when nothing is there now (``wait_readable``, then again)."""
        limit = min(max_bytes, RECEIVE_SIZE)
        self.drained = False
        have = self._read_plain(limit)
        if have is not None and not have and not self._eof:
            try:
                n = os.readv(self._fd, [self._raw_view])
            except BlockingIOError:
                n = -1
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            if n >= 0:
                self._feed(self._raw_view[:n])
            have = self._read_plain(limit)
            # Bytes returned, the kernel gave less than asked and every complete record is
            # decrypted: the next receive_nowait would only find EAGAIN.
            self.drained = have is not None and 0 < n < RECEIVE_SIZE and have > 0 and not self._rest
        if have is None:
            self._read_busy = True  # wait_readable waits for the thread's piece instead
            return None
        if not self._queued and self._out.pending:
            self._write_nowait()  # a post-handshake message the read produced; rest: flush()
        if have or self._eof:
            return bytes(self._view[:have])
        return None

    @property
    def unsent(self) -> bool:
        """Bytes wait for ``flush()``: encrypted here and not written, or more than
        ``OFFLOAD_BACKLOG`` with the sender thread (under that, they are on their way)."""
        if self._queued:
            return self._backlog > OFFLOAD_BACKLOG
        return bool(self._unsent) or self._out.pending > 0

    async def wait_readable(self) -> None:
        if self._read_busy:
            self._read_busy = False
            await self._wait_ssl_lock()
            return
        await trio.lowlevel.wait_readable(self.transport_stream.socket)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """close_notify (best effort), with ``linger_on_close`` a lingering close (``common.linger``),
        then close the socket (and end the sender thread)."""
        try:
            with trio.move_on_after(0.5):
                try:
                    await self._wait_sender(0)
                except trio.BrokenResourceError:
                    pass  # the thread's write failed: nothing more to wait for, close anyway
            self._stop_sender()
            if not self._queued and self._sender_error is None:
                with self._ssl_lock:  # free: nothing is queued
                    try:
                        self._obj.unwrap()
                    except ssl.SSLError:
                        pass
                with trio.move_on_after(0.5):
                    await self._flush_quietly()
                if self.linger_on_close:
                    await linger(self.transport_stream)
        finally:
            self._stop_sender()
            await self.transport_stream.aclose()

    # -- the sender thread -------------------------------------------------------------------

    def _check_sender(self) -> None:
        if self._sender_error is not None:
            raise trio.BrokenResourceError(f"socket connection broken: {self._sender_error}")

    def _offload(self, data: bytes | bytearray | memoryview) -> bool:
        with self._state:
            if self._closing:
                raise trio.ClosedResourceError("the TLS stream is closed")
            if self._sender is None:
                self._token = trio.lowlevel.current_trio_token()
                # A duplicate of the socket's descriptor: the thread's writes can never reach
                # a reused descriptor if the socket is closed under it (it exits then).
                fd = os.dup(self._fd)
                sender = threading.Thread(
                    target=self._run_sender, args=(fd,), name="tls-sender", daemon=True
                )
                try:
                    sender.start()
                except BaseException:
                    os.close(fd)
                    raise  # nothing was taken: the stream is as it was
                self._sender = sender
            # Only once the thread runs: ciphertext not yet sent goes before the new bytes.
            first, self._unsent = self._unsent, memoryview(b"")
            self._queued += 1
            self._backlog += len(first) + len(data)
            self._jobs.put((first, data))
            below = self._backlog <= OFFLOAD_BACKLOG
        self.offloaded += 1
        return below

    async def _wait_sender(self, backlog: int) -> None:
        """Until the thread holds at most ``backlog`` unsent bytes (0: no job at all)."""
        while True:
            with self._state:
                self._check_sender()
                if self._backlog <= backlog and (backlog or not self._queued):
                    return
                wake = self._waiter_event()
            await wake.wait()

    async def _wait_ssl_lock(self) -> None:
        """Until the thread lets go of the SSL lock (one piece of encryption at most)."""
        while True:
            with self._state:
                if not self._ssl_lock.locked() or self._sender_error is not None:
                    return
                wake = self._waiter_event()
            await wake.wait()

    def _waiter_event(self) -> trio.Event:
        """Holding ``_state``: the event the thread sets on its next progress. One for all
        waiters (Execution in ``flush`` and Reading in ``wait_readable`` can wait at once):
        each re-checks its own condition when woken, so none may replace another's."""
        if self._wake is None:
            self._wake = trio.Event()
        return self._wake

    def _stop_sender(self) -> None:
        with self._state:
            self._closing = True
            if self._sender is not None:
                self._jobs.put(None)

    def _notify_locked(self) -> None:
        """From the thread, holding ``_state``: wake the trio side if it waits."""
        wake, self._wake = self._wake, None
        if wake is not None and self._token is not None:
            try:
                self._token.run_sync_soon(wake.set)
            except trio.RunFinishedError:
                pass

    def _closed(self) -> bool:
        return self._closing or self.transport_stream.socket.fileno() < 0

    def _write_fd(self, fd: int, data: bytes | memoryview, poller: select.poll) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                if self._closed():
                    raise BrokenPipeError("the TLS stream was closed") from None
                poller.poll(SENDER_TICK_S * 1000)

    def _run_sender(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        idle = 0.0
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=SENDER_TICK_S)
                except queue.Empty:
                    idle += SENDER_TICK_S
                    with self._state:
                        if self._jobs.empty() and (idle >= SENDER_IDLE_EXIT_S or self._closed()):
                            self._sender = None
                            return
                    continue
                idle = 0.0
                if job is None:
                    with self._state:
                        if self._jobs.empty():
                            self._sender = None
                            return
                    continue
                self._run_job(fd, job, poller)
        except BaseException as exc:
            # Not an IO error (_run_job handles those): still, no waiter may wait forever
            # for a thread that is gone.
            with self._state:
                if self._sender_error is None:
                    self._sender_error = exc
                self._queued = 0
                self._backlog = 0
                self._sender = None
                self._notify_locked()
            raise
        finally:
            os.close(fd)

    def _run_job(self, fd: int, job: _Job, poller: select.poll) -> None:
        first, data = job
        left = len(first) + len(data)  # of this job's bytes in _backlog
        try:
            if self._sender_error is not None or self._closed():
                raise BrokenPipeError("the TLS stream was closed")
            if first:
                self._write_fd(fd, first, poller)
                with self._state:
                    self._backlog -= len(first)
                    left -= len(first)
            view = memoryview(data)
            step = self._offload_piece
            for at in range(0, len(view), step):
                piece = view[at : at + step]
                with self._ssl_lock:
                    self._obj.write(piece)
                    out = self._out.read()
                with self._state:
                    self._notify_locked()  # a reader waiting for the SSL lock may go on
                self._write_fd(fd, out, poller)
                with self._state:
                    self._backlog -= len(piece)
                    left -= len(piece)
                    if self._backlog <= OFFLOAD_BACKLOG:
                        self._notify_locked()
            # What a read put into the outgoing BIO meanwhile (a post-handshake message)
            # goes before the job counts as done: after that, the trio side writes it.
            while True:
                with self._ssl_lock:
                    done = not self._out.pending
                    if done:
                        with self._state:
                            self._queued -= 1
                    else:
                        out = self._out.read()
                if done:
                    # After the release: a reader woken while the lock was still held would
                    # see it taken, wait again, and nothing would wake it.
                    with self._state:
                        self._notify_locked()
                    return
                self._write_fd(fd, out, poller)
        except (OSError, ssl.SSLError) as exc:
            with self._state:
                if self._sender_error is None:
                    self._sender_error = exc
                self._queued -= 1
                self._backlog -= left
                self._notify_locked()
