"""What the event streams may cost the server, in bytes, and the counts that follow from it
(``docs/EVENTS.md``, "Bounds").

A subscriber's messages wait in its connection's pipe (libzmq's queue between the socket
and the connection's I/O), then in the kernel's send buffer. libzmq bounds a pipe in
messages (``SNDHWM``), not bytes, so the publisher bounds the bytes of a message
(:data:`MESSAGE_BATCH_BYTES`) and derives the high-water mark from the bytes a subscriber
may hold (:attr:`EventBounds.hwm`); the kernel's share is fixed with ``SO_SNDBUF``
(:data:`KERNEL_SNDBUF`). Every subscriber, and every ticket that may become one, counts
against its session, its tenant and the server (``_event_ledger``): their bounds in bytes
are those counts times :attr:`EventBounds.subscriber_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

MESSAGE_BATCH_BYTES = 40 << 10
"""A message's batch at most: 1,024 keys of 32 bytes in one event take 35 KiB; changes of
alternating kinds (an event of about 140 bytes per key) are cut until they fit."""
KEYS_PER_MESSAGE = 1024
"""Keys the publisher puts in one message before it checks its size (the stream's format
allows 4,096: ``MAX_KEYS_PER_MESSAGE``)."""
MESSAGE_BYTES = MESSAGE_BATCH_BYTES + (1 << 10)
"""What one queued message may hold: its batch, its other frames (routing id, topic,
sequence), libzmq's four 64-byte message slots and the allocator's rounding."""
CONNECTION_BYTES = 64 << 10
"""A subscriber's connection besides its messages: libzmq's session, engine, its 8 KiB
batch buffers and pipe chunks (measured: 29 KiB idle, 50 KiB with a full pipe)."""
KERNEL_SNDBUF = 64 << 10
"""``SO_SNDBUF`` of each subscriber's connection: Linux keeps up to twice this (128 KiB)
of kernel memory per connection; left unset, autotuning grows it to ``tcp_wmem``'s
maximum (4 MiB on a stock kernel)."""
QUEUE_BYTES = 2 << 20
"""A subscriber's queue on the server by default (``events_queue_bytes``): 48 messages, up
to 49,000 keys behind, beyond what its own socket and both kernels hold."""
SERVER_BYTES = 256 << 20
"""What every subscriber together may hold by default (``events_memory``): 124
subscribers of the default queue."""
MESSAGES_CAP = 1000
"""Messages a subscriber's queue holds at most whatever its bytes (``events_hwm``): the
byte bound usually makes it fewer."""

SESSION_TICKETS = 8
"""Unused tickets one session holds at once: one for each namespace it may have open
(``MAX_NAMESPACES_PER_SESSION``)."""
SESSION_SUBSCRIBERS = 16
"""Subscribers of one session's tickets at once: two per namespace it may open (a mirror's
subscription and the one it replaces, which counts until its connection is gone)."""


@dataclass(frozen=True)
class EventBounds:
    """The bounds that follow from the settings ``events_queue_bytes`` (``queue_bytes``),
    ``events_memory`` (``server_bytes``) and ``events_hwm`` (``messages``)."""

    queue_bytes: int = QUEUE_BYTES
    server_bytes: int = SERVER_BYTES
    messages: int = MESSAGES_CAP

    @property
    def hwm(self) -> int:
        """``SNDHWM``: the pipe holds this many messages, and the connection one more as
        it writes it, all within ``queue_bytes``."""
        return max(0, min(self.messages, self.queue_bytes // MESSAGE_BYTES - 1))

    @property
    def subscriber_bytes(self) -> int:
        """One subscriber at most, in the server's memory: its queue and its connection."""
        return (self.hwm + 1) * MESSAGE_BYTES + CONNECTION_BYTES

    @property
    def subscribers(self) -> int:
        """Subscribers (and tickets that may become one) the server holds at once."""
        return self.server_bytes // self.subscriber_bytes

    def problem(self) -> tuple[str, str] | None:
        """What is wrong with these settings, and which one: ``None`` when nothing."""
        if self.hwm < 1:
            low = 2 * MESSAGE_BYTES
            return "events_queue_bytes", f"events_queue_bytes must be at least {low} (2 messages)"
        if self.subscribers < 1:
            return "events_memory", (
                f"events_memory {self.server_bytes} holds no subscriber of "
                f"{self.subscriber_bytes} bytes (events_queue_bytes and its connection)"
            )
        return None
