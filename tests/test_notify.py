"""sd_notify against real AF_UNIX datagram sockets, and the watchdog pinger."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from skilltrain.daemon.core.notify import MAX_STATUS_CHARS, Heartbeat, Notifier, WatchdogPinger


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd, and its $NOTIFY_SOCKET."""
    path = str(tmp_path / "notify")
    assert len(path) < 100, "AF_UNIX paths are limited to 108 bytes"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield sock, path
    sock.close()


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    name = f"skilltrain-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    yield sock, "@" + name
    sock.close()


def received(sock: socket.socket, wait_s: float = 0.0) -> list[bytes]:
    """Every datagram queued now (wait_s=0), or arriving within wait_s."""
    out = []
    deadline = time.monotonic() + wait_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            sock.settimeout(remaining)
        else:
            sock.setblocking(False)
        try:
            out.append(sock.recv(65536))
        except (BlockingIOError, TimeoutError):
            return out


def test_messages_are_exact_datagrams(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    notifier.ready()
    notifier.status("scanning runs/\nstep 3\r\nof 9")
    notifier.stopping()
    notifier.watchdog()
    notifier.send(STATUS="done", EXTEND_TIMEOUT_USEC=5_000_000)
    assert received(sock) == [
        b"READY=1",
        b"STATUS=scanning runs/ step 3  of 9",  # one line: a newline would forge a field
        b"STOPPING=1",
        b"WATCHDOG=1",
        b"STATUS=done\nEXTEND_TIMEOUT_USEC=5000000",
    ]
    assert notifier.errors == 0


def test_abstract_socket(abstract_listener: tuple[socket.socket, str]) -> None:
    sock, name = abstract_listener
    Notifier.from_env({"NOTIFY_SOCKET": name}).ready()
    assert received(sock) == [b"READY=1"]


def test_unset_sends_nothing_and_never_fails(listener: tuple[socket.socket, str]) -> None:
    sock, _ = listener
    notifier = Notifier.from_env({"WATCHDOG_USEC": "200000"})
    assert not notifier.enabled
    notifier.ready()
    notifier.status("x")
    notifier.stopping()
    notifier.watchdog()
    notifier.send(READY=1)
    assert notifier.watchdog_interval_s is None
    assert notifier.errors == 0
    assert received(sock, wait_s=0.1) == []


def test_long_status_is_capped(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    Notifier.from_env({"NOTIFY_SOCKET": path}).status("x" * 10_000)
    (datagram,) = received(sock)
    assert datagram == b"STATUS=" + b"x" * MAX_STATUS_CHARS


def test_send_rejects_field_names_that_are_not_upper_case() -> None:
    with pytest.raises(ValueError, match="upper case"):
        Notifier(None).send(ready=1)


def test_socket_gone_is_swallowed_and_reported(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    seen: list[tuple[str, OSError]] = []
    notifier = Notifier.from_env(
        {"NOTIFY_SOCKET": path}, on_error=lambda field, exc: seen.append((field, exc))
    )
    notifier.ready()
    assert received(sock) == [b"READY=1"]
    # The manager re-executed or went away: the path is gone.
    sock.close()
    os.unlink(path)
    notifier.watchdog()
    notifier.status("still here")
    assert notifier.errors == 2
    assert isinstance(notifier.last_error, FileNotFoundError)
    assert [field for field, _ in seen] == ["WATCHDOG", "STATUS"]


def test_bad_notify_socket_disables_and_reports() -> None:
    seen: list[str] = []
    notifier = Notifier.from_env(
        {"NOTIFY_SOCKET": "relative/path"}, on_error=lambda field, exc: seen.append(field)
    )
    assert not notifier.enabled
    notifier.ready()
    assert seen == ["NOTIFY_SOCKET"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"WATCHDOG_USEC": "200000"}, 0.1),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "4242"}, 0.1),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "4243"}, None),  # meant for another pid
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(
    extra: dict[str, str], expected: float | None
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "/run/x", **extra}, pid=4242)
    assert notifier.watchdog_interval_s == expected


def test_watchdog_pid_defaults_to_our_own() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "200000"}
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 0.1
    assert (
        Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval_s is None
    )


def watchdog_notifier(path: str, usec: int = 200_000) -> Notifier:
    return Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(usec)})


def test_pinger_cadence(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    stop = threading.Event()
    pinger = WatchdogPinger(watchdog_notifier(path), lambda: True, stop)
    pinger.start()
    time.sleep(0.6)
    stop.set()
    pinger.join(2)
    pings = received(sock)
    # One at start, then every 0.1 s: 7 in 0.6 s, with room for a slow machine.
    assert set(pings) == {b"WATCHDOG=1"}
    assert 5 <= len(pings) <= 8, len(pings)
    assert pinger.pings == len(pings)


def test_pinger_stops_pinging_when_the_checked_thread_dies(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="observer-stand-in")
    worker.start()
    unhealthy = threading.Event()
    stop = threading.Event()
    pinger = WatchdogPinger(
        watchdog_notifier(path), worker.is_alive, stop, on_unhealthy=unhealthy.set
    )
    pinger.start()
    try:
        assert len(received(sock, wait_s=0.35)) >= 2
        release.set()
        worker.join()
        time.sleep(0.15)  # a ping decided before the death may still be on its way
        received(sock)
        assert received(sock, wait_s=0.5) == []
        assert unhealthy.is_set()
        assert pinger.alive  # still watching, just silent
    finally:
        stop.set()
        pinger.join(2)
    assert pinger.skipped >= 3


def test_pinger_resumes_when_health_returns(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    healthy = threading.Event()
    stop = threading.Event()
    pinger = WatchdogPinger(watchdog_notifier(path), healthy.is_set, stop)
    pinger.start()
    try:
        assert received(sock, wait_s=0.3) == []
        healthy.set()
        assert len(received(sock, wait_s=0.3)) >= 2
    finally:
        stop.set()
        pinger.join(2)


def test_failing_health_check_means_unhealthy(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener

    def broken() -> bool:
        raise RuntimeError("scheduler gone")

    stop = threading.Event()
    pinger = WatchdogPinger(watchdog_notifier(path), broken, stop)
    pinger.start()
    try:
        assert received(sock, wait_s=0.3) == []
        assert pinger.alive
    finally:
        stop.set()
        pinger.join(2)


def test_pinger_stops_promptly(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    stop = threading.Event()
    pinger = WatchdogPinger(watchdog_notifier(path, usec=20_000_000), lambda: True, stop)
    pinger.start()
    sock.settimeout(1.0)
    assert sock.recv(4096) == b"WATCHDOG=1"  # then it sleeps for 10 s
    started = time.monotonic()
    stop.set()
    pinger.join(2)
    assert not pinger.alive
    assert time.monotonic() - started < 0.5


def test_pinger_is_a_noop_without_watchdog(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    stop = threading.Event()
    pinger = WatchdogPinger(Notifier.from_env({"NOTIFY_SOCKET": path}), lambda: True, stop)
    pinger.start()
    assert not pinger.alive
    assert received(sock, wait_s=0.1) == []


def test_heartbeat_uses_the_given_clock() -> None:
    now = [100.0]
    beat = Heartbeat(clock=lambda: now[0])
    now[0] = 130.0
    assert beat.age_s() == 30.0
    assert beat.recent(30.0)
    assert not beat.recent(29.9)
    beat.beat()
    assert beat.age_s() == 0.0
