"""Rank 0's side of the lambdas: the run created and its lambdas read before the first step, then
polled in the background.

:func:`fetch_first` runs once at attach, over a transport whose deadline the agent sets (both
requests within ``INITIAL_FETCH_SECONDS``); a :class:`LambdaPoller` thread (``qkwatch-lambdas``)
then asks every ``lambda_poll_seconds``. Both hand each answer to ``offer`` (``Lambdas.offer`` in
``agent.lambdas.lambdas``, which validates it value by value); nothing an answer holds raises out
of here, and the poller outlives anything an answer does to it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from qkwatch.agent.identity import RunIdentity
from qkwatch.agent.shipping.transport import Transport, TransportError
from qkwatch.contract import api

logger = logging.getLogger(__name__)


class LambdaPoller:
    """Rank 0 only: fetch the run's lambdas every ``period`` seconds once the run exists."""

    def __init__(
        self,
        run_id: Callable[[], str | None],
        transport_factory: Callable[[], Transport],
        offer: Callable[[dict[str, Any]], bool],
        period: float,
    ):
        self.run_id = run_id
        """The collector's id of the run (the sender learns it), or None while it is unknown."""
        self.transport_factory = transport_factory
        self.offer = offer
        self.period = period
        self.answered = 0
        """Polls whose answer was offered (taken or not)."""
        self.failed = 0
        """Polls that got no answer (the collector away, or refusing)."""
        self._unexpected: set[str] = set()  # kinds of exception already warned about
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkwatch-lambdas", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poll_once(self, transport: Transport) -> bool:
        run_id = self.run_id()
        if run_id is None:
            return False
        try:
            answer = transport.get_lambdas(run_id)
        except TransportError as exc:  # the transport warns (once per kind) about a hostile answer
            logger.debug("lambdas not fetched: %s", exc)
            self.failed += 1
            return False
        taken = self.offer(answer)  # what it refuses or clips, it warns about (once) and reports
        self.answered += 1
        return taken

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        transport = self.transport_factory()
        try:
            while not self._stop.is_set():
                try:
                    self.poll_once(transport)
                except Exception as exc:  # the poller outlives anything an answer does to it
                    self.failed += 1
                    self._warn_unexpected(exc)
                self._stop.wait(self.period)
        finally:
            transport.close()

    def _warn_unexpected(self, exc: Exception) -> None:
        kind = type(exc).__name__
        if kind not in self._unexpected:
            self._unexpected.add(kind)
            logger.warning("qkwatch: a lambdas poll failed (%s: %s); polling on", kind, str(exc)[:200])


def fetch_first(transport: Transport, identity: RunIdentity, offer: Callable[[dict[str, Any]], bool]) -> str | None:
    """Before the first step: create (or resume) the run and offer its lambdas, if the collector answers.

    Returns the run's id, or None when the collector did not answer, or answered what is not a run
    (the sender creates the run later). Nothing an answer holds raises out of here.
    """
    try:
        run_id = transport.create_run(identity.create_body()).get("id")
        if not isinstance(run_id, str) or not run_id:
            raise TransportError(f"POST {api.RUNS}: the answer names no run", retryable=True)
    except TransportError as exc:
        logger.info("qkwatch: collector not reachable at start (%s); working offline until it is", exc)
        return None
    except Exception as exc:  # attach() must not fail on an answer
        logger.warning(
            "qkwatch: the collector's answer to POST %s could not be used (%s)", api.RUNS, type(exc).__name__
        )
        return None
    try:
        offer(transport.get_lambdas(run_id))
    except TransportError as exc:
        logger.info("qkwatch: collector not reachable at start (%s); working offline until it is", exc)
    except Exception as exc:  # nor on the lambdas
        logger.warning("qkwatch: the collector's lambdas could not be used (%s)", type(exc).__name__)
    return run_id
