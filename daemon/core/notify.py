"""sd_notify without a C binding, and the watchdog pinger built on it.

systemd's notify protocol is one datagram of ``KEY=value`` lines sent to the
unix socket named by ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract
namespace). With ``Type=notify`` the unit is "started" only once READY=1
arrives; with ``WatchdogSec=`` systemd kills and restarts the service when
WATCHDOG=1 stops arriving. Outside systemd every call is a cheap no-op, so the
daemon calls these unconditionally.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping

# systemd reads at most PIPE_BUF (4096) bytes of one notification: a capped
# STATUS= (<= 2 KiB even in 4-byte UTF-8) cannot push fields sent with it out.
MAX_STATUS_CHARS = 512
# A blocked sendto() would stall the caller (the main loop or the pinger); a
# notification that cannot be delivered in this long is better dropped.
SEND_TIMEOUT_S = 2.0

_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*")

ErrorCallback = Callable[[str, OSError], None]


def _socket_address(value: str) -> str | bytes:
    """Turn $NOTIFY_SOCKET into a sendto() address, or raise ValueError."""
    if value.startswith("@") and len(value) > 1:
        # The abstract namespace: a leading NUL byte instead of the "@".
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # systemd >= 253 also offers "vsock:CID:PORT"; a daemon on the host never gets one.
    raise ValueError(f"NOTIFY_SOCKET must be an absolute path or @name, got {value!r}")


def _one_line(value: object) -> str:
    """A field value on one line: a newline would start a forged field."""
    return str(value).replace("\r", " ").replace("\n", " ")


class Notifier:
    """Sends service state to systemd; does nothing when not run by systemd.

    Delivery errors (socket gone after a manager re-exec, a full queue) never
    raise: they are counted, kept in ``last_error`` and passed to ``on_error``.
    """

    def __init__(
        self,
        address: str | bytes | None,
        *,
        watchdog_usec: int | None = None,
        on_error: ErrorCallback | None = None,
    ) -> None:
        self._address = address
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._on_error = on_error
        self.errors = 0
        self.last_error: OSError | None = None

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] = os.environ,
        *,
        pid: int | None = None,
        on_error: ErrorCallback | None = None,
    ) -> Notifier:
        """Build from $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID.

        The watchdog is honoured only when WATCHDOG_PID is unset or names us
        (``pid``, default ``os.getpid()``): a child that inherited the
        environment must not ping on its parent's behalf.
        """
        raw_socket = environ.get("NOTIFY_SOCKET", "")
        if not raw_socket:
            return cls(None)
        try:
            address: str | bytes | None = _socket_address(raw_socket)
        except ValueError as exc:
            if on_error is not None:
                on_error("NOTIFY_SOCKET", OSError(str(exc)))
            address = None
        return cls(address, watchdog_usec=_watchdog_usec(environ, pid), on_error=on_error)

    @property
    def enabled(self) -> bool:
        """True when there is a systemd socket to talk to."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of WATCHDOG_USEC (as sd_watchdog_enabled advises)."""
        if self._address is None or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2_000_000

    def ready(self) -> None:
        """READY=1: startup finished; systemctl start returns now."""
        self._send_text("READY=1")

    def status(self, text: str) -> None:
        """STATUS=...: one line shown by ``systemctl status``."""
        if self._address is not None:
            self._send_text(f"STATUS={_one_line(text)[:MAX_STATUS_CHARS]}")

    def stopping(self) -> None:
        """STOPPING=1: shutdown began (systemd then expects the exit)."""
        self._send_text("STOPPING=1")

    def watchdog(self) -> None:
        """WATCHDOG=1: still alive and healthy."""
        self._send_text("WATCHDOG=1")

    def send(self, **fields: object) -> None:
        """Send arbitrary fields in one datagram, e.g. ``send(READY=1, STATUS="up")``."""
        for name in fields:
            if not _FIELD_NAME.fullmatch(name):
                # A programming error, not a delivery error: make it loud.
                raise ValueError(f"sd_notify field names are upper case, got {name!r}")
        if self._address is not None and fields:
            self._send_text("\n".join(f"{k}={_one_line(v)}" for k, v in fields.items()))

    def _send_text(self, text: str) -> None:
        address = self._address
        if address is None:
            return
        # A socket per message, as sd_notify() does: nothing to keep open, lock
        # or close, and a manager that re-created its socket is found again.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(text.encode(), address)
        except OSError as exc:
            self.errors += 1
            self.last_error = exc
            if self._on_error is not None:
                self._on_error(text.partition("=")[0], exc)


def _watchdog_usec(environ: Mapping[str, str], pid: int | None) -> int | None:
    """WATCHDOG_USEC when it is meant for process ``pid``, else None."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner:
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec if usec > 0 else None


class Heartbeat:
    """Records that a loop made progress; answers "recently?" for a health check."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()

    def beat(self) -> None:
        """Call once per loop iteration."""
        self._last = self._clock()

    def age_s(self) -> float:
        """Seconds since the last beat (or since construction)."""
        return self._clock() - self._last

    def recent(self, max_age_s: float) -> bool:
        """True when the last beat is at most ``max_age_s`` old."""
        return self.age_s() <= max_age_s


class WatchdogPinger:
    """A daemon thread that sends WATCHDOG=1 while the service is healthy.

    ``is_healthy`` is asked before every ping; when it answers False (or
    raises) the ping is skipped, so a wedged daemon is killed and restarted
    by systemd after WatchdogSec= without pings. A daemon that recovers
    within that window pings again. ``on_unhealthy`` is called once per
    healthy-to-unhealthy transition so the daemon can log why.
    """

    def __init__(
        self,
        notifier: Notifier,
        is_healthy: Callable[[], bool],
        stop: threading.Event,
        *,
        on_unhealthy: Callable[[], None] | None = None,
    ) -> None:
        self._notifier = notifier
        self._is_healthy = is_healthy
        self._stop = stop
        self._on_unhealthy = on_unhealthy
        self._thread: threading.Thread | None = None
        self.pings = 0
        self.skipped = 0

    def start(self) -> None:
        """Start pinging; a no-op when systemd asked for no watchdog."""
        interval = self._notifier.watchdog_interval_s
        if interval is None or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="sd-watchdog", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after ``stop.set()``)."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the pinger thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _healthy(self) -> bool:
        try:
            return bool(self._is_healthy())
        except Exception:  # a failing check means "not healthy", never a dead thread
            return False

    def _report_unhealthy(self) -> None:
        if self._on_unhealthy is None:
            return
        try:
            self._on_unhealthy()
        except Exception:  # a broken log call must not end the pinger
            pass

    def _run(self, interval: float) -> None:
        was_healthy = True
        while not self._stop.is_set():
            healthy = self._healthy()
            if healthy:
                self._notifier.watchdog()
                self.pings += 1
            else:
                self.skipped += 1
                if was_healthy:
                    self._report_unhealthy()
            was_healthy = healthy
            # wait() rather than sleep(): stop.set() ends the thread at once.
            if self._stop.wait(interval):
                return
