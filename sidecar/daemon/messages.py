"""The messages one read returned, handled in order: a sender that may not use the
sidecar refused, consecutive RECORDS aggregated together, each control message
dispatched and answered (with progress while a write it caused goes on); an error on
one message counted, logged and answered, never stopping the loop."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from markers import wire
from sidecar.daemon.access import Access
from sidecar.daemon.dispatch import Dispatcher
from sidecar.daemon.ownership import Owners
from sidecar.exports.export_worker import Exports
from sidecar.ingest.hello_check import Refused
from sidecar.ingest.receiver import Incoming, Receiver
from sidecar.ingest.streams import Registry
from sidecar.sinks import writer

log = logging.getLogger("sidecar")


class Messages:
    """Handles decoded messages for the loop (the writes ``dispatcher`` runs report their
    progress through ``progress``). ``sent_away``: the runs whose hello was refused (their
    connection ends as the markers hang up)."""

    def __init__(
        self,
        registry: Registry,
        access: Access,
        owners: Owners,
        receiver: Receiver,
        exports: Exports,
        dispatcher: Dispatcher,
        sent_away: deque[bytes],
    ) -> None:
        self.registry = registry
        self.access = access
        self.owners = owners
        self.receiver = receiver
        self.exports = exports
        self.sent_away = sent_away
        self.dispatcher = dispatcher
        self._waiting: tuple[bytes, Any] | None = None  # (identity, reply_to) being answered

    def progress(self, what: str) -> None:
        """Tell the client whose request caused this write that it goes on: a finish
        waiting for it, or a run that checkpointed and may ask for more meanwhile (its
        markers take any progress reply as news)."""
        if self._waiting is not None:
            identity, reply_to = self._waiting
            self.receiver.reply(identity, {"reply_to": reply_to, "progress": what})

    def _foreign(self, message: Incoming) -> tuple[str, str] | None:
        """(the reject kind, why) when the sender of ``message`` may not use this sidecar
        (``Access.foreign``) or the run it names is not its own (``Owners.refusal``)."""
        run_id = message.header.run_id
        foreign = self.access.foreign(message.peer, self.registry.streams.get(run_id))
        if foreign is not None:
            return "foreign_user", foreign
        body = message.control
        hello = body if body is not None and body.get("type") == wire.HELLO else None
        return self.owners.refusal(run_id, message.peer, hello)

    def handle(self, message: Incoming, now_unix: float) -> None:
        """Dispatch one decoded message (refused when its sender may not use us)."""
        body = message.control or {}
        foreign = self._foreign(message)
        if foreign is not None:
            self.registry.reject(*foreign)
            self._reply(message, body, {"ok": False, "error": foreign[1]})
            return
        if message.records is not None:
            self.registry.records(message.header, message.records, now_unix)
            return
        if "reply_to" in body:
            self._waiting = (message.identity, body["reply_to"])
        try:
            self.access.take_hello(
                body, message.peer, known=message.header.run_id in self.registry.streams
            )
            if self.access.shared:  # a finish writes within the block: import before it
                writer.load_modules()
            with self.access.acting(message.peer):
                reply = self.dispatcher.dispatch(message.header, body, now_unix, message.peer)
            if body["type"] == wire.HELLO and reply is not None and reply.get("ok"):
                self.owners.bind(message.header.run_id, message.peer, body)
                self.access.say_where(body, reply)
                self._exports_hello(message.header.run_id, reply)
        except wire.WireError as exc:
            self.registry.reject(exc.kind, str(exc))
            reply = {"ok": False, "error": str(exc)}
        except Refused as exc:
            self.registry.reject("refused", str(exc))
            self.registry.last_error = str(exc)
            reply = {"ok": False, "error": str(exc)}
        self._reply(message, body, reply)
        try:  # a checkpoint's writing: its progress still goes to that client (see progress)
            later, self.dispatcher.later = self.dispatcher.later, []
            for action in later:
                action()
        finally:
            self._waiting = None

    def _exports_hello(self, run_id: bytes, reply: dict[str, Any]) -> None:
        """Choose the exports of the split a hello joined; their warning (an unknown name,
        a library not installed) goes with the reply."""
        stream = self.registry.streams.get(run_id)
        warning = self.exports.hello(stream.split) if stream is not None else None
        if warning:
            reply["warning"] = "; ".join(filter(None, (reply.get("warning"), warning)))

    def _reply(
        self,
        message: Incoming,
        body: dict[str, Any],
        reply: dict[str, Any] | None,
    ) -> None:
        """Answer ``message`` with ``reply`` when its sender asked for one."""
        if "reply_to" in body and reply is not None:
            self.receiver.reply(message.identity, {"reply_to": body["reply_to"], **reply})
            if body["type"] == wire.HELLO and not reply.get("ok"):
                self.sent_away.append(message.header.run_id)  # the markers hang up now

    def handle_all(self, messages: list[Incoming]) -> None:
        """Handle what one read returned, in order. Consecutive RECORDS messages are
        aggregated together (``Registry.records_batch``): the work per message stays in
        Python, the work per record in arrays. A control message is handled after the
        records before it."""
        batch: list[Incoming] = []
        for message in messages:
            if message.records is not None:
                batch.append(message)
                continue
            self._records_safely(batch)
            batch = []
            self.handle_safely(message)
        self._records_safely(batch)

    def _records_safely(self, batch: list[Incoming]) -> None:
        """Aggregate RECORDS messages, those of senders that may not use us refused; any
        error counted and logged, as ``handle_safely``."""
        taken = []
        for message in batch:
            foreign = self._foreign(message)
            if foreign is not None:
                self.registry.reject(*foreign)
            elif message.records is not None:
                taken.append((message.header, message.records))
        if not taken:
            return
        try:
            self.registry.records_batch(taken, time.time())
        except Exception as exc:  # the loop must survive anything
            log.exception("internal error on records of %d messages", len(taken))
            self.registry.reject("internal_error", repr(exc))

    def handle_safely(self, message: Incoming) -> None:
        """``handle``, with any error counted and logged: one bad message never stops the
        sidecar nor loses what it holds.
        """
        try:
            self.handle(message, time.time())
        except Exception as exc:  # the loop must survive anything
            log.exception("internal error on a message from run %s", message.header.run_id.hex())
            self.registry.reject("internal_error", repr(exc))
            self._waiting = None
            self.dispatcher.later.clear()
            body = message.control or {}
            if "reply_to" in body:  # a waiting client learns at once, not by its timeout
                self.receiver.reply(
                    message.identity,
                    {"reply_to": body["reply_to"], "ok": False, "error": repr(exc)},
                )
